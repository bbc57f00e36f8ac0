"""A search's keys (``hydra.sweeper.*``), named and checked as Hydra's Optuna sweeper names them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.config import ConfigError, invalid

DIRECTIONS = ("minimize", "maximize")
SAMPLERS = ("tpe", "random", "qmc")
PRUNERS = ("none", "median", "asha", "hyperband")
KEY = "hydra.sweeper."


@dataclass(frozen=True)
class SearchSettings:
    n_trials: int = 20  # trials in all, those a killed controller already ran included
    n_jobs: int = 2  # trials kept running at once: the moment one ends, the next is submitted
    direction: str = "minimize"  # minimize | maximize the objective
    objective: str = "eval_loss"  # a key of the trials' metrics.jsonl; its last value is the trial's
    sampler: str = "tpe"  # tpe (with constant liar: running trials count) | random | qmc
    seed: int | None = None  # the sampler's seed
    pruner: str = "none"  # none | median | asha (successive halving) | hyperband
    params: dict[str, str] = field(default_factory=dict)  # {config key: Hydra sweep text}
    poll_s: float = 2.0  # how often the controller reads the registry and the trials' metrics

    def __post_init__(self) -> None:
        for key in ("n_trials", "n_jobs"):
            if getattr(self, key) < 1:
                raise invalid(f"{KEY}{key}", getattr(self, key), "must be >= 1", f"{KEY}{key}=1")
        for key, choices in (("direction", DIRECTIONS), ("sampler", SAMPLERS), ("pruner", PRUNERS)):
            if getattr(self, key) not in choices:
                raise invalid(f"{KEY}{key}", getattr(self, key), f"choose one of {choices}",
                              f"{KEY}{key}={choices[0]}")
        if not self.objective:
            raise invalid(f"{KEY}objective", self.objective, "name a key of metrics.jsonl",
                          f"{KEY}objective=eval_loss")
        if not self.poll_s > 0:
            raise invalid(f"{KEY}poll_s", self.poll_s, "must be > 0", f"{KEY}poll_s=2")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SearchSettings:
        known = set(cls.__dataclass_fields__)
        stray = sorted(set(values) - known)
        if stray:
            raise ConfigError(f"{KEY}{stray[0]} is not a search setting (known: {', '.join(sorted(known))})")
        return cls(**values)
