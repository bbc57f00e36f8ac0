"""The sweeper's config schema, registered under ``hydra/sweeper`` when Hydra scans its plugins.

Every field is documented on :class:`orchestrator.search.settings.SearchSettings`; Hydra's Optuna
sweeper names the shared ones alike, so its users switch by changing ``hydra/sweeper=``."""

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class SwitchyardOptunaConf:
    _target_: str = "hydra_plugins.switchyard_optuna.sweeper.SwitchyardOptunaSweeper"
    n_trials: int = 20
    n_jobs: int = 2
    direction: str = "minimize"
    objective: str = "eval_loss"
    sampler: str = "tpe"
    seed: Optional[int] = None  # noqa: UP045 -- OmegaConf's schemas take Optional, not X | None
    pruner: str = "none"
    poll_s: float = 2.0
    params: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="switchyard_optuna", node=SwitchyardOptunaConf,
                             provider="switchyard")
