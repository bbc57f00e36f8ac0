"""Every float field of every config dataclass refuses NaN, infinities and negative values.

The fields are found by introspection, not listed: a float field added later is covered the day it
is added. NaN compares false with everything, so a range check alone (``lr <= 0``) let
``optim.lr=nan`` through and the run trained on NaN (issue 27).
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from orchestrator import config
from orchestrator.config import ConfigError


def config_dataclasses() -> list[type]:
    return [cls for _, cls in inspect.getmembers(config, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == config.__name__]


def float_fields() -> list[tuple[type, str]]:
    found = []
    for cls in config_dataclasses():
        hints = typing.get_type_hints(cls)
        found += [(cls, f.name) for f in dataclasses.fields(cls)
                  if hints[f.name] is float or float in typing.get_args(hints[f.name])]
    return found


def test_the_introspection_finds_the_float_fields_we_know() -> None:
    names = {f"{cls.__name__}.{name}" for cls, name in float_fields()}
    assert {"OptimConfig.lr", "OptimConfig.weight_decay", "OptimConfig.clip_grad_norm",
            "ClusterConfig.mem_gb", "ClusterConfig.rendezvous_timeout_s",
            "ClusterConfig.collective_timeout_s", "TelemetryConfig.interval_s",
            "GptConfig.dropout"} <= names


def build(cls: type, **values: Any) -> Any:
    """``cls`` with its required (MISSING) fields filled by a plain value."""
    required = {f.name: "x" for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**{**required, **values})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0])
@pytest.mark.parametrize(("cls", "name"), float_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_every_float_field_refuses_non_finite_and_negative(cls: type, name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\b{name}={value!r} is invalid: .* \(try .*{name}="):
        build(cls, **{name: value})


@pytest.mark.parametrize(("cls", "name"), float_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_the_default_of_every_float_field_passes(cls: type, name: str) -> None:
    build(cls)


def test_optim_lr_nan_is_one_error_line_from_jobs_train(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "optim.lr=nan",
                           f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == \
        "error: optim.lr=nan is invalid: must be a finite number (try optim.lr=0.003)"
