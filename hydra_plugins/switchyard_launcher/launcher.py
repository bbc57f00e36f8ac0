"""The Hydra ``Launcher`` plugin: a thin adapter over :func:`orchestrator.sweeps.launcher.launch`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from orchestrator.sweeps import launcher as sweep


class SwitchyardLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.settings = sweep.LauncherSettings.from_params(params)
        self.state = sweep.SweepState()  # one registry sweep across Hydra's batches
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config
        sweep.install_composition_cache(hydra_context)  # the sweeper validates through it next

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.hydra_context is None or self.task_function is None or self.config is None:
            raise RuntimeError("SwitchyardLauncher.launch called before setup")
        return sweep.launch(self.settings, self.hydra_context, self.task_function, self.config,
                            job_overrides, initial_job_idx, self.state)
