"""Helpers the loader and batch-memory tests share (``pythonpath = tests`` makes this importable)."""

from __future__ import annotations

import numpy as np
import torch

Sample = dict[str, np.ndarray]


def assert_batches_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys in the same order, and per key the same dtype, shape and values."""
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
        assert got.shape == want.shape, (key, got.shape, want.shape)
        assert torch.equal(got, want), key


def varied_samples(num: int, max_rows: int = 40, seed: int = 0) -> list[Sample]:
    """x: float32[rows, 3], rows 0..max_rows; y: int64 label; img: uint8[2, 2] (constant)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((int(rng.integers(0, max_rows + 1)), 3)).astype(np.float32),
            "y": np.int64(i),
            "img": np.full((2, 2), i % 256, np.uint8),
        }
        for i in range(num)
    ]
