"""The Hydra ``Sweeper`` plugin: a thin adapter over :mod:`orchestrator.search.controller`.

Hydra's sweepers hand a launcher batches and wait for each; this one submits each trial itself,
as an ordinary job of the app, the moment a running one ends. The launcher Hydra configured
(``hydra/launcher``) is not used."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from orchestrator.config import ConfigError
from orchestrator.terminal import one_line


class SwitchyardOptunaSweeper(Sweeper):
    def __init__(self, **params: Any) -> None:
        # the config's mappings as plain dicts (params is nested by its dotted keys)
        self.params = {k: OmegaConf.to_container(v) if isinstance(v, DictConfig) else v
                       for k, v in params.items() if k != "_target_"}
        self.config: DictConfig | None = None
        self.app = ""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        module = inspect.getmodule(inspect.unwrap(task_function))
        spec = getattr(module, "__spec__", None)
        self.app = spec.name if spec is not None else getattr(module, "__name__", "")

    def sweep(self, arguments: Sequence[str]) -> Any:
        # Imported here, not at the top: Hydra imports every plugin module at each app's start, and
        # Optuna's import costs about 0.2 s that a run not searching must not pay.
        from orchestrator.registry.db import Registry, RegistryError
        from orchestrator.search import controller
        from orchestrator.search.settings import SearchSettings

        if self.config is None:
            raise RuntimeError("SwitchyardOptunaSweeper.sweep called before setup")
        try:
            searched, base = split_arguments(arguments)
            params = {**flatten(cast(Mapping[str, Any], self.params.get("params") or {})), **searched}
            settings = SearchSettings.from_dict({**self.params, "params": params})
            plan = controller.check(settings, base, self.app)  # nothing is submitted before this
            with Registry() as registry:
                controller.start(plan, registry, Path(str(self.config.hydra.sweep.dir)).absolute(),
                                 str(self.config.hydra.job.name), " ".join(arguments))
        except (ConfigError, controller.SearchError, RegistryError) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            sys.exit(2)
        return None




def split_arguments(arguments: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The command line's sweeps (``'optim.lr=tag(log, interval(1e-5, 1e-1))'``, as Hydra's Optuna
    sweeper takes them) become search parameters; every other override is each trial's."""
    parser = OverridesParser.create()
    searched, base = {}, []
    for text in arguments:
        override = parser.parse_override(text)
        if override.is_sweep_override():
            searched[override.get_key_element()] = text.partition("=")[2]
        else:
            base.append(text)
    return searched, base


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``hydra.sweeper.params.optim.lr=...`` arrives nested (``{optim: {lr: ...}}``): back to dotted keys."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat
