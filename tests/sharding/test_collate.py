"""Padding collate and length-grouped batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding import DatasetError, collate_padded, length_grouped_batches, open_dataset
from sharding.collate import padding_fraction


def _sample(rows: int, label: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1,
            "y": torch.tensor(label), "img": torch.ones(3, 2, dtype=torch.uint8) * label}


def test_variable_fields_are_padded_with_lengths_and_mask():
    batch = collate_padded([_sample(2, 0), _sample(0, 1), _sample(3, 2)], fixed={"img"})
    assert set(batch) == {"x", "x_lengths", "x_mask", "y", "img"}
    assert batch["x"].shape == (3, 3, 2) and batch["x"].dtype == torch.float32
    assert batch["x_lengths"].tolist() == [2, 0, 3] and batch["x_lengths"].dtype == torch.int64
    assert batch["x_mask"].tolist() == [[True, True, False], [False] * 3, [True] * 3]
    assert torch.equal(batch["x"][0, :2], _sample(2, 0)["x"])
    assert (batch["x"][0, 2:] == 0).all() and (batch["x"][1] == 0).all()
    assert batch["y"].tolist() == [0, 1, 2]  # scalars are stacked
    assert batch["img"].shape == (3, 3, 2)  # fixed fields are stacked, no mask


def test_keys_do_not_depend_on_the_batch():
    """Equal lengths in one batch still get lengths and mask, so every batch has the same keys."""
    batch = collate_padded([_sample(2, 0), _sample(2, 1)])
    assert set(batch) == {"x", "x_lengths", "x_mask", "y", "img", "img_lengths", "img_mask"}


def test_pad_value_and_numpy_input():
    batch = collate_padded([{"x": np.ones(1, np.int16)}, {"x": np.ones(3, np.int16)}],
                           pad_value=-1)
    assert batch["x"].tolist() == [[1, -1, -1], [1, 1, 1]]


def test_collate_errors_name_the_field():
    with pytest.raises(DatasetError, match="field 'x' mixes"):
        collate_padded([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 4)}])
    with pytest.raises(DatasetError, match="field 'x' is treated as fixed-shape"):
        collate_padded([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}], fixed={"x"})
    with pytest.raises(DatasetError, match="item 1 has fields"):
        collate_padded([{"x": torch.zeros(2)}, {"z": torch.zeros(2)}])
    with pytest.raises(DatasetError, match="empty batch"):
        collate_padded([])
    with pytest.raises(DatasetError, match="'x_mask' collides"):
        collate_padded([{"x_mask": torch.zeros(1), "x": torch.zeros(1)}] * 2)


def test_collate_of_dataset_samples_with_its_fixed_fields(write_dataset):
    samples = [{"tok": np.arange(n, dtype=np.int64), "img": np.full((2, 2), n, np.uint8)}
               for n in (3, 1, 4)]
    ds = open_dataset(write_dataset(samples))
    assert ds.fixed_fields == {"img"}  # its leading size is 2 in every sample
    batch = collate_padded([ds[i] for i in range(3)], fixed=ds.fixed_fields)
    assert batch["tok"].tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [0, 1, 2, 3]]
    assert batch["img"].shape == (3, 2, 2) and "img_mask" not in batch


def _skewed_lengths(n: int, seed: int) -> np.ndarray:
    """Mostly short sequences and a long tail, like tokenized text."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 1.0, n), 1, 4096).astype(np.int64)


def test_length_grouping_cuts_padding_on_a_skewed_distribution(capsys):
    lengths = _skewed_lengths(20_000, seed=0)
    indices = np.arange(len(lengths))
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(indices)
    plain = [shuffled[s:s + 32] for s in range(0, len(shuffled), 32)]
    grouped = length_grouped_batches(indices, lengths, batch_size=32, seed=0)
    plain_waste = padding_fraction(plain, lengths)
    grouped_waste = padding_fraction(grouped, lengths)
    with capsys.disabled():
        print(f"\n  padding, lognormal lengths, batch 32: random batches {plain_waste:.1%}, "
              f"length-grouped {grouped_waste:.1%}")
    assert plain_waste > 0.5
    assert grouped_waste < plain_waste / 4


def test_length_grouped_batches_use_each_index_once_and_are_deterministic():
    lengths = _skewed_lengths(1000, seed=1)
    indices = np.arange(5000, 6000)
    a = length_grouped_batches(indices, lengths, batch_size=16, seed=7, batches_per_group=4)
    b = length_grouped_batches(indices, lengths, batch_size=16, seed=7, batches_per_group=4)
    c = length_grouped_batches(indices, lengths, batch_size=16, seed=8, batches_per_group=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert sorted(np.concatenate(a).tolist()) == indices.tolist()
    assert len(a) == math.ceil(1000 / 16)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), batch_size=st.integers(1, 40), per_group=st.integers(1, 8),
       drop_last=st.booleans(), seed=st.integers(0, 2**32))
def test_length_grouping_keeps_the_batch_count_of_plain_batching(n, batch_size, per_group,
                                                                 drop_last, seed):
    lengths = np.random.default_rng(seed).integers(0, 50, n)
    batches = length_grouped_batches(np.arange(n), lengths, batch_size, seed,
                                     batches_per_group=per_group, drop_last=drop_last)
    expected = n // batch_size if drop_last else math.ceil(n / batch_size)
    assert len(batches) == expected
    assert sum(len(b) < batch_size for b in batches) <= (0 if drop_last else 1)
    used = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    assert len(np.unique(used)) == len(used)


def test_length_grouping_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="lengths"):
        length_grouped_batches(np.arange(3), np.arange(4), 2, 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        length_grouped_batches(np.arange(3), np.arange(3), 0, 0)
