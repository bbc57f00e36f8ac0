"""Switchyard's Hydra launchers: ``hydra/launcher=switchyard_slurm`` and ``switchyard_local``.

The logic lives in :mod:`orchestrator.sweeps.launcher`; this package only plugs it into Hydra. It lives in the
``hydra_plugins`` namespace package (which has no ``__init__.py``), where Hydra looks for plugins.
"""
