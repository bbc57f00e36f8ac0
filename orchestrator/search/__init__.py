"""Hyperparameter search: an asynchronous ask/tell loop over Optuna whose trials are ordinary jobs.

``space`` (Hydra's sweep grammar -> Optuna distributions, pure), ``settings`` (the search's keys and
their checks), ``study`` (Optuna's storage in the sweep directory, samplers, pruners), ``metrics``
(a trial's ``metrics.jsonl`` read as it grows), ``controller`` (the loop: keep ``n_jobs`` trials
running, prune, tell, resume) and ``view`` (``switchyard status``'s trials, ``switchyard best``).
"""
