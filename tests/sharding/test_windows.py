"""Token windows packed across documents: the right tokens, every target once per epoch, equal
counts on every rank, exactly-once evaluation, and elastic resume through the sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding import DatasetError, DatasetWriter, ShardedSampler, open_dataset
from sharding.windows import TokenWindows, window_loader


def write_docs(path: Path, docs: list[np.ndarray], shard_bytes: int = 160) -> TokenWindows:
    with DatasetWriter(path, shard_bytes=shard_bytes) as writer:
        for doc in docs:
            writer.append({"tokens": doc.astype(np.uint16)})
    return TokenWindows(open_dataset(path), "tokens", seq_len=5)


def docs_of(lengths: list[int]) -> list[np.ndarray]:
    start, docs = 0, []
    for n in lengths:  # token k of the stream has value k % 60000: the window's position shows
        docs.append(np.arange(start, start + n) % 60000)
        start += n
    return docs


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 23), min_size=1, max_size=12))
def test_each_window_is_the_stream_at_its_offset(tmp_path_factory: pytest.TempPathFactory,
                                                 lengths: list[int]) -> None:
    total = sum(lengths)
    if total < 6:
        return  # fewer tokens than one window: refused below
    windows = write_docs(tmp_path_factory.mktemp("w") / "ds", docs_of(lengths))
    assert len(windows) == (total - 1) // 5 == sum(windows.shard_counts)
    batch = windows.__getitems__(list(range(len(windows))))
    stream = torch.arange(total)
    for w in range(len(windows)):
        assert batch["input"][w].tolist() == stream[w * 5:w * 5 + 5].tolist()
        assert batch["target"][w].tolist() == stream[w * 5 + 1:w * 5 + 6].tolist()
    targets = batch["target"].flatten().tolist()
    assert targets == list(range(1, len(windows) * 5 + 1))  # every target once, in order


def test_shard_counts_follow_each_windows_first_token(tmp_path: Path) -> None:
    windows = write_docs(tmp_path / "ds", docs_of([7, 7, 7, 7]), shard_bytes=16)  # one doc a shard
    starts = [w * 5 for w in range(len(windows))]  # tokens 0, 5, 10, ... ; shards end at 7, 14, 21
    expected = [sum(1 for s in starts if lo <= s < hi) for lo, hi in ((0, 7), (7, 14), (14, 21), (21, 28))]
    assert list(windows.shard_counts) == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_get_equal_batches_and_eval_sees_every_window_once(tmp_path: Path, world: int) -> None:
    windows = write_docs(tmp_path / "ds", docs_of([13, 2, 40, 9, 31]))
    seen, counts = [], set()
    for rank in range(world):
        sampler = ShardedSampler(windows.shard_counts, world_size=world, rank=rank, policy="pad",
                                 shuffle=False)
        batches = list(window_loader(windows, sampler, batch_size=3))
        counts.add(len(batches))
        seen += [int(i) for b in batches for i, pad in zip(b["index"], b["is_pad"], strict=True) if not pad]
    assert len(counts) == 1
    assert sorted(seen) == list(range(len(windows)))


def test_a_resumed_sampler_reads_the_windows_an_uninterrupted_one_would(tmp_path: Path) -> None:
    windows = write_docs(tmp_path / "ds", docs_of([50, 3, 70, 20]))
    straight = ShardedSampler(windows.shard_counts, world_size=2, rank=1, seed=3)
    order = list(straight)
    stopped = ShardedSampler(windows.shard_counts, world_size=2, rank=1, seed=3)
    stopped.advance(4)
    resumed = ShardedSampler(windows.shard_counts, world_size=2, rank=1, seed=3)
    resumed.load_state_dict(stopped.state_dict())
    assert list(resumed) == order[4:]
    elastic = ShardedSampler(windows.shard_counts, world_size=3, rank=0, seed=3)
    elastic.load_state_dict(stopped.state_dict())  # the sampler's elastic resume works on windows
    assert len(list(elastic)) > 0


def test_refusals_name_the_field_and_the_fix(tmp_path: Path) -> None:
    with DatasetWriter(tmp_path / "rows") as writer:
        writer.append({"x": np.zeros((3, 2), np.float32)})
    with pytest.raises(DatasetError, match=r"field 'x' must be 1-D integer tokens.*x: float32"):
        TokenWindows(open_dataset(tmp_path / "rows"), "x", 4)
    windows = write_docs(tmp_path / "ds", docs_of([8]))
    other = ShardedSampler([3, 4], world_size=1, rank=0)
    with pytest.raises(DatasetError, match="other window counts"):
        window_loader(windows, other, batch_size=2)
