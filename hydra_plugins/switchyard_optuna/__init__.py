"""Switchyard's Hydra sweeper: ``hydra/sweeper=switchyard_optuna``, an asynchronous Optuna search
whose trials are Switchyard jobs. The logic lives in :mod:`orchestrator.search`; this package only
plugs it into Hydra, with the keys of Hydra's own Optuna sweeper (``n_trials``, ``n_jobs``,
``direction``, ``sampler``, ``params``) and Switchyard's (``objective``, ``pruner``)."""
