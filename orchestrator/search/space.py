"""The search space, declared as Hydra's Optuna sweeper declares it (``hydra.sweeper.params``):
``interval(1e-4, 1e-2)``, ``tag(log, interval(...))``, ``choice(a, b)``, ``range(1, 8)`` or a
plain value. Hydra's own override parser reads each one; this module turns what it read into an
Optuna distribution, refusing an empty range or a log range reaching 0, and turns a trial's
values back into overrides. Pure: no I/O, no Optuna study."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from orchestrator.config import ConfigError

PREFIX = "hydra.sweeper.params."  # how the keys are named in errors: as the user typed them


def parse(params: Mapping[str, str]) -> tuple[dict[str, BaseDistribution], dict[str, Any]]:
    """``{key: Hydra sweep text}`` -> (the distributions searched, the fixed values)."""
    parser = OverridesParser.create()
    searched: dict[str, BaseDistribution] = {}
    fixed: dict[str, Any] = {}
    for key, text in params.items():
        try:
            override = parser.parse_override(f"{key}={text}")
        except HydraException as e:
            raise ConfigError(f"{PREFIX}{key}={text!r} cannot be parsed: {_first_line(e)} (e.g. "
                              f"'{PREFIX}{key}=tag(log, interval(1e-5, 1e-1))' or choice(a, b))") from e
        if override.is_sweep_override():
            searched[key] = distribution(key, text, override.value())
        else:
            fixed[key] = override.value()
    if not searched:
        raise ConfigError("hydra.sweeper.params searches nothing: give at least one range, e.g. "
                          f"'{PREFIX}optim.lr=tag(log, interval(1e-5, 1e-1))'")
    return searched, fixed


def distribution(key: str, text: str, sweep: Any) -> BaseDistribution:
    """One parsed sweep as Optuna's distribution; every refusal names the key and a fix."""
    where = f"{PREFIX}{key}={text!r}"
    if isinstance(sweep, IntervalSweep):
        low, high, log = sweep.start, sweep.end, "log" in sweep.tags
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ConfigError(f"{where} is an empty range: its start must be below its end "
                              f"(e.g. interval(1e-5, 1e-1))")
        if log and low <= 0:
            raise ConfigError(f"{where} is a log range reaching 0: a log range's start must be > 0 "
                              f"(e.g. tag(log, interval(1e-6, {high:g})))")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log)
        return FloatDistribution(float(low), float(high), log=log)
    if isinstance(sweep, (RangeSweep, ChoiceSweep)):
        values = list(_range_values(sweep)) if isinstance(sweep, RangeSweep) else list(sweep.list)
        if not values:
            raise ConfigError(f"{where} is an empty range: it has no values (e.g. range(1, 8) or "
                              f"choice(a, b))")
        if any(isinstance(v, (list, dict)) for v in values):
            raise ConfigError(f"{where}: a choice's values must be numbers, strings or booleans")
        return CategoricalDistribution(cast(list[Any], values))
    raise ConfigError(f"{where} is not a search range: use interval, tag(log, interval), choice or range")


def _range_values(sweep: RangeSweep) -> list[Any]:
    """range(start, stop, step) as Hydra sweeps it (stop excluded), floats rounded as typed."""
    start, stop, step = sweep.start, sweep.stop, sweep.step
    if step == 0 or start is None or stop is None:
        return []
    count = max(0, math.ceil((stop - start) / step))
    values = [start + i * step for i in range(count)]
    return values if all(isinstance(v, int) for v in values) else [round(v, 12) for v in values]


def overrides(values: Mapping[str, Any], fixed: Mapping[str, Any]) -> list[str]:
    """A trial's values and the fixed ones as command-line overrides, ready to paste."""
    return [f"{key}={_text(value)}" for key, value in {**fixed, **values}.items()]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
