"""The sampler's and the loader's refusals come before submission, not from every rank after the
queue wait: data.policy=drop over more ranks than samples, data.group_by_length on fixed-length data."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from jobs import train
from orchestrator.config import ConfigError, TrainConfig
from sharding import DatasetWriter


def config(tmp_path: Path, *overrides: str) -> TrainConfig:
    with initialize_config_module("conf", version_base="1.3"):
        composed = compose("train", overrides=[f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    return cast(TrainConfig, OmegaConf.to_object(composed))


def dataset(path: Path, num_samples: int, rows: list[int]) -> Path:
    """``x`` float32 [rows, 16] (the row counts cycle through ``rows``), ``y`` int64 labels 0..3."""
    with DatasetWriter(path) as writer:
        for i in range(num_samples):
            writer.append({"x": np.ones((rows[i % len(rows)], 16), np.float32), "y": np.int64(i % 4)})
    return path


def test_drop_over_more_ranks_than_samples_is_refused_naming_both(tmp_path: Path) -> None:
    data = dataset(tmp_path / "one", 1, [3])
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, f"data.path={data}", "data.num_classes=4",
                                         "data.policy=drop", "parallelism.procs_per_node=2"))
    assert str(refused.value) == (
        f"data.policy=drop is invalid: data.path='{data}' has 1 sample for 2 ranks, so every rank "
        f"would get none (try data.policy=pad, which pads with flagged samples, or at most 1 rank)")
    train.check_before_submit(config(tmp_path, f"data.path={data}", "data.num_classes=4",
                                     "data.policy=drop", "parallelism.procs_per_node=1"))


def test_group_by_length_on_fixed_length_data_is_refused_naming_the_shapes(tmp_path: Path) -> None:
    fixed = dataset(tmp_path / "fixed", 64, [8])
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, f"data.path={fixed}", "data.num_classes=4",
                                         "data.group_by_length=true"))
    assert str(refused.value) == (
        f"data.group_by_length=true is invalid: every field of data.path='{fixed}' has one shape in "
        f"every sample (x: float32[8, 16], y: int64[]), so there is no length to group by "
        f"(try data.group_by_length=false)")
    varied = dataset(tmp_path / "varied", 64, [3, 8])
    train.check_before_submit(config(tmp_path, f"data.path={varied}", "data.num_classes=4",
                                     "data.group_by_length=true"))
