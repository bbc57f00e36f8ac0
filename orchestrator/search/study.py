"""The Optuna study of a search: its storage is a journal file in the sweep directory, so a
controller killed at any moment leaves every ask and tell on disk and a new one loads them
(Optuna's JournalStorage appends one line per operation, under a file lock); the sampler and the
pruner are chosen by name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, cast

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from orchestrator.search.settings import SearchSettings

STUDY_FILE = "study.journal"
STUDY_NAME = "search"

optuna.logging.set_verbosity(logging.WARNING)  # the controller prints its own line per trial


def sampler(settings: SearchSettings) -> optuna.samplers.BaseSampler:
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    if settings.sampler == "qmc":
        return optuna.samplers.QMCSampler(seed=settings.seed)
    # constant_liar: a trial still running counts as a poor one, so trials asked while others run
    # spread out instead of all landing on the same promising point (asynchronous search).
    return optuna.samplers.TPESampler(seed=settings.seed, constant_liar=True)


def pruner(settings: SearchSettings, first_step: int, last_step: int) -> optuna.pruners.BasePruner:
    """``first_step``: the first intermediate value's step (eval_every_steps), the least resource a
    trial is judged on; ``last_step``: a trial's last (optim.max_steps)."""
    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=first_step)
    if settings.pruner == "asha":
        # reduction 3: a third of the trials reaching a rung go on to the next (rungs at 1, 3, 9...
        # times first_step)
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first_step, reduction_factor=3)
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first_step,
                                              max_resource=max(last_step, first_step), reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(sweep_dir: Path, settings: SearchSettings, first_step: int, last_step: int) -> optuna.Study:
    """The sweep's study, made on first use and loaded after: a resumed controller gets the same one."""
    storage = JournalStorage(JournalFileBackend(str(sweep_dir / STUDY_FILE)))
    direction = cast(Literal["minimize", "maximize"], settings.direction)  # checked by SearchSettings
    return optuna.create_study(storage=storage, study_name=STUDY_NAME, direction=direction,
                               sampler=sampler(settings), pruner=pruner(settings, first_step, last_step),
                               load_if_exists=True)
