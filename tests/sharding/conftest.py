"""Shared fixtures for the sharded-dataset tests: real files under tmp_path, no mocks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sharding.writer import DatasetWriter

Sample = dict[str, np.ndarray]
WriteDataset = Callable[..., Path]
SamplesEqual = Callable[[Mapping[str, Any], Mapping[str, Any]], None]


def _mixed_samples(num: int, seed: int = 0) -> list[Sample]:
    """x: float32[rows, 4] with rows 0..5 (0-row samples included), y: int64[], tokens: int32[*]."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        rows = int(rng.integers(0, 6)) if i != 1 else 0  # sample 1 always has 0 rows
        samples.append({
            "x": rng.standard_normal((rows, 4)).astype(np.float32),
            "y": np.int64(i * 7 - 3),
            "tokens": rng.integers(-(2**31), 2**31 - 1, int(rng.integers(0, 9)), dtype=np.int32),
        })
    return samples


@pytest.fixture
def mixed_samples() -> list[Sample]:
    return _mixed_samples(60)


@pytest.fixture
def make_samples() -> Callable[..., list[Sample]]:
    return _mixed_samples


@pytest.fixture
def write_dataset(tmp_path: Path) -> WriteDataset:
    """``write_dataset(samples, name="ds", **writer_kwargs) -> path`` of the published dataset."""

    def write(samples: Sequence[Mapping[str, Any]], name: str = "ds", **kwargs: Any) -> Path:
        path = tmp_path / name
        with DatasetWriter(path, **kwargs) as writer:
            for sample in samples:
                writer.append(sample)
        return path

    return write


@pytest.fixture
def dataset_path(write_dataset: WriteDataset, mixed_samples: list[Sample]) -> Path:
    """60 mixed samples in several shards (shard_bytes=256)."""
    return write_dataset(mixed_samples, shard_bytes=256)


def assert_samples_equal(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Same field names, and per field the same dtype, the same shape and the same values."""
    assert list(actual) == list(expected)
    for name, want in expected.items():
        want_arr = np.asarray(want)
        got = np.asarray(actual[name])
        assert got.dtype == want_arr.dtype, (name, got.dtype, want_arr.dtype)
        assert got.shape == want_arr.shape, (name, got.shape, want_arr.shape)
        np.testing.assert_array_equal(got, want_arr, err_msg=name)


@pytest.fixture
def samples_equal() -> SamplesEqual:
    return assert_samples_equal
