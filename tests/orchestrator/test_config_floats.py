"""Every float field of every config dataclass refuses NaN, infinities, negative values, values
outside the range it declares, and values torch cannot hold as a float32.

The fields are found by introspection, not listed: a float field added later is covered the day it
is added. NaN compares false with everything, so a range check alone (``lr <= 0``) let
``optim.lr=nan`` through and the run trained on NaN (issue 27); ``optim.lr=1e308`` is finite in
Python and failed on every rank, ``value cannot be converted to type float without overflow``
(issue 34).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from train_helpers import run_train

from orchestrator import config
from orchestrator.config import FLOAT32_MAX, ConfigError, Range


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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, 1e39, 1e-300])
@pytest.mark.parametrize(("cls", "name"), float_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_every_float_field_refuses_non_finite_and_negative(cls: type, name: str, value: float) -> None:
    given = re.escape(repr(value))
    with pytest.raises(ConfigError, match=rf"\b{name}={given} is invalid: .* \(try .*{name}="):
        build(cls, **{name: value})


@pytest.mark.parametrize(("cls", "name"), float_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_the_default_of_every_float_field_passes(cls: type, name: str) -> None:
    build(cls)


@pytest.mark.parametrize(("cls", "name"), float_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_the_largest_value_a_field_takes_is_a_finite_float32(cls: type, name: str) -> None:
    values = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("range", Range())
    largest = min(values.high, FLOAT32_MAX)
    if values.high_open:
        largest = float(torch.nextafter(torch.tensor(largest, dtype=torch.float64), torch.tensor(0.0)))
    assert getattr(build(cls, **{name: largest}), name) == largest
    assert torch.isfinite(torch.tensor(largest, dtype=torch.float32))


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lr=1e308", "optim.lr=1e+308 is invalid: must be > 0 and <= 10 (try optim.lr=0.003)"),
    ("optim.clip_grad_norm=1e39", "optim.clip_grad_norm=1e+39 is invalid: must be a float32, as torch "
     "holds it: at most 3.403e+38, and 0 or at least 1.4e-45 (less rounds to 0) "
     "(try optim.clip_grad_norm=0.0)"),
    ("optim.momentum=1", "optim.momentum=1.0 is invalid: must be >= 0 and < 1 (try optim.momentum=0.9)"),
    ("cluster.collective_timeout_s=1e20", "cluster.collective_timeout_s=1e+20 is invalid: must be > 0 and "
     "<= 31536000, a year (try cluster.collective_timeout_s=600.0)"),
])
def test_a_float_that_overflows_where_it_is_used_is_refused_from_the_command_line(
        override: str, message: str) -> None:
    config.register_configs()
    with initialize_config_module("conf", version_base="1.3"):
        composed = compose("train", overrides=[override])
    with pytest.raises(Exception) as refused:
        OmegaConf.to_object(composed)
    assert str(refused.value.__cause__ or refused.value) == message


def test_optim_lr_nan_is_one_error_line_from_jobs_train(tmp_path: Path) -> None:
    # the one test of jobs.train's exit code and one-line format in a new interpreter (cold)
    proc = run_train("optim.lr=nan", run_dir=tmp_path, timeout=120, cold=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == \
        "error: optim.lr=nan is invalid: must be a finite number (try optim.lr=0.003)"
