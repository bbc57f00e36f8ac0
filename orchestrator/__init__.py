"""Everything between a config and running ranks, one subpackage per concern.

- ``config``, ``atomic``, ``cli`` (top level): every schema and check; atomic file writes; the
  ``switchyard`` command;
- ``launch``: how ranks are started and find each other;
- ``training``: what each rank does;
- ``telemetry``: GPU/CPU memory over time, flags, summary, plot;
- ``sweeps``: Hydra sweeps, the registry, status;
- ``localcluster``: a real SLURM cluster on one machine.

Imports run one way (``tests/test_architecture.py`` fails on one against the grain):
``config``/``atomic`` <- ``launch``, ``telemetry`` <- ``training`` <- ``sweeps`` <- ``cli``.
Nothing here imports ``jobs``: an app hands its checks to the sweep launcher through
``config.register_app_check``.
"""
