"""The batched loader: batches equal the per-sample path, every entry once, real workers."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from batch_helpers import assert_batches_equal, varied_samples
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding import (
    BufferPool,
    DatasetError,
    RankDataset,
    ShardedSampler,
    collate_padded,
    make_loader,
    open_dataset,
    padding_fraction,
)
from sharding.loader import pass_batch
from sharding.sampler import SamplerStateError
from sharding.writer import DatasetWriter

WriteDataset = Callable[..., Path]


def per_sample_batch(rank_ds: RankDataset, values: Iterable[int], pad_value: float = 0) -> dict[str, Any]:
    """The reference: the per-sample path, collated by collate_padded."""
    return collate_padded([rank_ds[v] for v in values], fixed=rank_ds.fixed, pad_value=pad_value)


def entries(batches: Iterable[dict[str, torch.Tensor]]) -> list[tuple[int, bool]]:
    """(index, is_pad) of every entry of every batch, in order."""
    return [(int(i), bool(p)) for b in batches for i, p in zip(b["index"], b["is_pad"], strict=True)]


@pytest.fixture(scope="module")
def varied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """301 samples (odd, so two ranks need a padding entry) over several shards."""
    path = tmp_path_factory.mktemp("loader") / "varied"
    with DatasetWriter(path, shard_bytes=4096) as writer:
        for sample in varied_samples(301):
            writer.append(sample)
    return path


# ------------------------------------------------------------------------------------------------
# One batch: the same as the per-sample path


def test_batch_equals_collate_padded_of_per_sample_reads(dataset_path: Path) -> None:
    rank_ds = RankDataset(dataset_path)
    values = [3, ~7, 1, 59, ~0, 3]  # padding entries, a 0-row sample (1), a repeat
    batch = rank_ds.__getitems__(values)
    assert_batches_equal(batch, per_sample_batch(rank_ds, values))
    assert batch["index"].tolist() == [3, 7, 1, 59, 0, 3]
    assert batch["is_pad"].tolist() == [False, True, False, False, True, False]
    assert list(batch) == ["x", "x_lengths", "x_mask", "y", "tokens", "tokens_lengths",
                           "tokens_mask", "index", "is_pad"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.data())
def test_any_batch_equals_the_per_sample_path(varied_path: Path, indices: list[int],
                                              data: st.DataObject) -> None:
    pads = data.draw(st.lists(st.booleans(), min_size=len(indices), max_size=len(indices)))
    values = [~i if p else i for i, p in zip(indices, pads, strict=True)]
    rank_ds = RankDataset(varied_path)
    assert rank_ds.fixed == {"y", "img"}  # img never varies: stacked, like y
    assert_batches_equal(rank_ds.__getitems__(values), per_sample_batch(rank_ds, values))


def test_zero_length_samples(write_dataset: WriteDataset) -> None:
    samples = [{"x": np.zeros((rows, 2), np.float32) + rows, "y": np.int64(rows)} for rows in (0, 0, 3, 0)]
    rank_ds = RankDataset(write_dataset(samples))
    only_empty = rank_ds.__getitems__([0, 1, ~3])
    assert only_empty["x"].shape == (3, 0, 2) and only_empty["x_mask"].shape == (3, 0)
    assert only_empty["x_lengths"].tolist() == [0, 0, 0]
    assert_batches_equal(only_empty, per_sample_batch(rank_ds, [0, 1, ~3]))
    mixed = rank_ds.__getitems__([0, 2, 3])
    assert mixed["x_lengths"].tolist() == [0, 3, 0]
    assert (mixed["x"][0] == 0).all() and (mixed["x"][1] == 3).all()
    assert_batches_equal(mixed, per_sample_batch(rank_ds, [0, 2, 3]))


def test_pad_value_and_padding_fields(varied_path: Path) -> None:
    rank_ds = RankDataset(varied_path, fixed={"y"}, pad_value=7)  # img padded on request
    values = list(range(0, 300, 7))
    batch = rank_ds.__getitems__(values)
    assert_batches_equal(batch, per_sample_batch(rank_ds, values, pad_value=7))
    assert "img_mask" in batch and batch["x"][~batch["x_mask"]].eq(7).all()
    with pytest.raises(DatasetError, match=r"pad_value=-5 does not fit field 'img' \(uint8\)"):
        RankDataset(varied_path, fixed={"y"}, pad_value=-5)  # at construction, not mid-epoch


def test_batches_reuse_memory_only_once_released(varied_path: Path) -> None:
    rank_ds = RankDataset(varied_path)
    first = rank_ds.__getitems__(list(range(64)))
    expected = first["x"].clone()
    kept_view = first["x"][:2]  # a view keeps the buffer in use, as the batch itself does
    del first
    second = rank_ds.__getitems__(list(range(64, 128)))
    assert torch.equal(kept_view, expected[:2])  # not overwritten
    ptr = second["x"].data_ptr()
    del second
    third = rank_ds.__getitems__(list(range(64, 128)))
    assert third["x"].data_ptr() == ptr  # released: reused, no fresh pages


def test_buffer_pool_falls_back_when_every_buffer_is_held() -> None:
    pool = BufferPool(max_buffers=2)
    held = [torch.from_numpy(pool.block(80)[16:].view(np.float32)) for _ in range(3)]  # views
    assert len({t.data_ptr() for t in held}) == 3
    for k, t in enumerate(held):
        t.fill_(k)
    assert [t.tolist() for t in held] == [[k] * 16 for k in range(3)]  # none overwritten
    bigger = pool.block(800)  # none free: a fresh block, the pool unchanged
    assert bigger.shape == (800,) and bigger.dtype == np.uint8
    reused = held[0].data_ptr() - 16
    del held
    assert pool.block(80).ctypes.data == reused  # released: the first buffer again
    assert pool.block(8000).nbytes == 8000  # a free buffer grows to fit


def test_rank_dataset_pickles_without_buffers_and_reads_the_same(varied_path: Path) -> None:
    rank_ds = RankDataset(varied_path)
    before = rank_ds.__getitems__([5, ~6])
    clone = pickle.loads(pickle.dumps(rank_ds))
    assert_batches_equal(clone.__getitems__([5, ~6]), before)
    assert len(clone) == len(rank_ds) == 301


def test_errors_are_early_and_say_what_to_do(varied_path: Path, write_dataset: WriteDataset) -> None:
    with pytest.raises(DatasetError, match=r"'x', whose leading size varies"):
        RankDataset(varied_path, fixed={"x"})
    with pytest.raises(DatasetError, match=r"'nope', which is not a field"):
        RankDataset(varied_path, fixed={"nope"})
    clash = write_dataset([{"x": np.zeros((1, 2)), "index": np.int64(0)}], name="clash")
    with pytest.raises(DatasetError, match=r"\['index'\].*rename"):
        RankDataset(clash)
    with pytest.raises(DatasetError, match="empty batch"):
        RankDataset(varied_path).__getitems__([])
    other = ShardedSampler([300], world_size=1, rank=0)
    with pytest.raises(DatasetError, match=r"other shard counts \(300 samples\).*ShardedSampler"):
        make_loader(varied_path, other, batch_size=4)
    fixed_only = write_dataset([{"y": np.int64(1)}], name="fixed_only")
    with pytest.raises(DatasetError, match="group_by_length=False"):
        make_loader(fixed_only, ShardedSampler([1], world_size=1, rank=0), 4, group_by_length=True)


# ------------------------------------------------------------------------------------------------
# Whole epochs through a real DataLoader


def epoch(path: Path, *, world_size: int = 1, rank: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    ds = open_dataset(path)
    sampler = ShardedSampler(ds.shard_counts, world_size=world_size, rank=rank, seed=4)
    sampler.set_epoch(1)
    return list(make_loader(ds, sampler, **kwargs))


@pytest.mark.parametrize("group_by_length", [False, True])
def test_workers_give_the_same_batches_in_the_same_order(varied_path: Path, group_by_length: bool) -> None:
    common = {"world_size": 2, "rank": 1, "batch_size": 16, "group_by_length": group_by_length}
    in_process = epoch(varied_path, num_workers=0, **common)
    in_workers = epoch(varied_path, num_workers=2, **common)
    assert len(in_process) == len(in_workers) == 10  # ceil(151 / 16)
    for got, want in zip(in_workers, in_process, strict=True):  # all kept: no slot was reused early
        assert_batches_equal(got, want)


@pytest.mark.parametrize("group_by_length", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_entry_of_the_partition_once(varied_path: Path, group_by_length: bool,
                                           drop_last: bool) -> None:
    ds = open_dataset(varied_path)
    sampler = ShardedSampler(ds.shard_counts, world_size=2, rank=1, seed=4)
    loader = make_loader(ds, sampler, 16, group_by_length=group_by_length, drop_last=drop_last)
    batches = list(loader)
    assert len(batches) == len(loader) == (9 if drop_last else 10)
    expected = list(zip(sampler.partition.indices.tolist(), sampler.partition.is_pad.tolist(), strict=True))
    got = entries(batches)
    if drop_last:
        assert len(got) == 144 and all(len(b["index"]) == 16 for b in batches)
        assert not Counter(got) - Counter(expected)
    else:
        assert Counter(got) == Counter(expected)
        assert (got == expected) != group_by_length  # grouping reorders, plain keeps the order


@pytest.mark.parametrize("group_by_length", [False, True])
def test_two_ranks_cover_each_sample_once_under_pad(varied_path: Path, group_by_length: bool) -> None:
    per_rank = [entries(epoch(varied_path, world_size=2, rank=r, batch_size=32,
                              group_by_length=group_by_length)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 151
    real = sorted(i for rank in per_rank for i, is_pad in rank if not is_pad)
    assert real == list(range(301))
    assert sum(is_pad for rank in per_rank for _, is_pad in rank) == 1


def test_group_by_length_same_entries_less_padding(varied_path: Path) -> None:
    plain = epoch(varied_path, batch_size=16)
    grouped = epoch(varied_path, batch_size=16, group_by_length=True)
    assert Counter(entries(plain)) == Counter(entries(grouped))
    lengths = open_dataset(varied_path).leading_sizes("x")
    waste = [padding_fraction([b["index"].numpy() for b in run], lengths) for run in (plain, grouped)]
    assert waste[1] < waste[0] / 3, waste
    for batch in grouped:  # still honest batches: the mask matches the lengths
        assert batch["x_mask"].sum(1).tolist() == batch["x_lengths"].tolist()


def consume(loader: Iterable[dict[str, torch.Tensor]], sampler: ShardedSampler,
            num_batches: int | None = None) -> list[tuple[int, bool]]:
    """Train on num_batches batches (all if None), advancing the sampler as a trainer does."""
    seen = []
    for step, batch in enumerate(loader):
        if step == num_batches:
            break
        seen += entries([batch])
        sampler.advance(len(batch["index"]))
    return seen


@pytest.mark.parametrize("group_by_length", [False, True])
def test_same_world_resume_continues_exactly(varied_path: Path, group_by_length: bool) -> None:
    ds = open_dataset(varied_path)

    def fresh() -> tuple[ShardedSampler, Any]:
        sampler = ShardedSampler(ds.shard_counts, world_size=2, rank=0, seed=8)
        sampler.set_epoch(3)
        return sampler, make_loader(ds, sampler, 16, group_by_length=group_by_length)

    sampler, loader = fresh()
    uninterrupted = consume(loader, sampler)
    sampler, loader = fresh()
    before = consume(loader, sampler, num_batches=4)
    resumed_sampler, resumed_loader = fresh()
    resumed_sampler.load_state_dict(sampler.state_dict())
    resumed_sampler.set_epoch(3)
    assert len(resumed_loader) == len(loader) - 4
    assert before + consume(resumed_loader, resumed_sampler) == uninterrupted


def run_segment(ds: Any, state: dict[str, Any] | None, world_size: int, steps: int | None,
                group_by_length: bool = True) -> tuple[list[int], dict[str, Any]]:
    """Every rank of a world trains ``steps`` batches of 16 (all if None) from ``state``;
    -> (real samples they trained on, the state after)."""
    seen, states = [], []
    for rank in range(world_size):
        sampler = ShardedSampler(ds.shard_counts, world_size=world_size, rank=rank, seed=8)
        loader = make_loader(ds, sampler, 16, group_by_length=group_by_length)  # before the state
        if state is not None:
            sampler.load_state_dict(state)
        seen += [i for i, is_pad in consume(loader, sampler, steps) if not is_pad]
        states.append(sampler.state_dict())
    assert all(s == states[0] for s in states)  # ranks step in lockstep: one state for all
    return seen, states[0]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 4)), min_size=1, max_size=3),
       st.integers(1, 5))
def test_grouped_resume_on_other_worlds_covers_each_sample_once(
        varied_path: Path, stretches: list[tuple[int, int]], last_world: int) -> None:
    """Grouped batches, stopped and resumed on other world sizes mid-epoch: every sample of the
    epoch is trained on exactly once (pad policy), as without grouping."""
    ds = open_dataset(varied_path)
    seen, state = [], None
    for world_size, steps in stretches:
        part, state = run_segment(ds, state, world_size, steps)
        seen += part
    rest, _ = run_segment(ds, state, last_world, None)
    assert Counter(seen + rest) == Counter(range(301))


def test_resume_refuses_another_visit_order(varied_path: Path) -> None:
    ds = open_dataset(varied_path)
    _, grouped_state = run_segment(ds, None, 2, 2)
    assert grouped_state["visit_order"].startswith("length-grouped(field=x, batch_size=16")
    plain = ShardedSampler(ds.shard_counts, world_size=3, rank=0, seed=8)
    make_loader(ds, plain, 16)
    with pytest.raises(SamplerStateError,
                       match=r"order 'length-grouped.*order 'partition'.*before load_state_dict"):
        plain.load_state_dict(grouped_state)
    other = ShardedSampler(ds.shard_counts, world_size=2, rank=0, seed=8)
    make_loader(ds, other, 8, group_by_length=True)  # another batch size: another grouping
    with pytest.raises(SamplerStateError, match="batch_size=8"):
        other.load_state_dict(grouped_state)
    late = ShardedSampler(ds.shard_counts, world_size=2, rank=0, seed=8)
    late.load_state_dict(run_segment(ds, None, 2, 2, group_by_length=False)[1])
    with pytest.raises(SamplerStateError, match="order 'partition'"):
        make_loader(ds, late, 16, group_by_length=True)  # plain progress, grouped loader
    late.set_epoch(1)  # a fresh epoch owes nothing to the loaded state
    make_loader(ds, late, 16, group_by_length=True)


def test_a_worker_batch_is_one_shared_block(varied_path: Path) -> None:
    """Without rings: one shared-memory handle per batch for every tensor of it, not one each."""
    (batch, *_) = epoch(varied_path, batch_size=8, num_workers=1, ring_slots=0)
    assert all(tensor.is_shared() for tensor in batch.values())
    assert len({tensor.untyped_storage().data_ptr() for tensor in batch.values()}) == 1
    assert pass_batch(batch) is batch


def test_import_sharding_stays_free_of_torch() -> None:
    code = ("import sys, sharding; assert 'torch' not in sys.modules, 'eager torch'; "
            "from sharding import ShardedSampler, make_loader, Partition; "
            "assert 'torch' in sys.modules; print(ShardedSampler.__name__, make_loader.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ShardedSampler", "make_loader"]


# ------------------------------------------------------------------------------------------------
# Signals sent to the whole job reach the workers too


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_workers_leave_the_stop_signals_to_the_main_process(varied_path: Path, signum: int) -> None:
    """SLURM signals every process of the step. Before: a worker died of SIGTERM through torch's
    worker handler and the next batch raised "DataLoader worker (pid N) is killed by signal", so a
    preempted trainer never reached the step where it would checkpoint. Now the workers ignore it,
    the main process's handler sees it once, and every batch still arrives."""
    seen: list[int] = []
    previous = signal.signal(signum, lambda s, f: seen.append(s))
    try:
        sampler = ShardedSampler(open_dataset(varied_path).shard_counts, world_size=1, rank=0, seed=0)
        loader = make_loader(varied_path, sampler, batch_size=16, num_workers=2,
                             persistent_workers=False, worker_ignores=(signal.SIGTERM, signal.SIGUSR2))
        iterator = iter(loader)
        first = next(iterator)
        workers = [w.pid for w in iterator._workers]  # type: ignore[attr-defined]
        for pid in [*workers, os.getpid()]:  # what `scancel --signal` does to a job step
            os.kill(pid, signum)
        time.sleep(0.5)  # long enough for a worker that dies of it to be noticed
        rest = list(iterator)
    finally:
        signal.signal(signum, previous)
    assert seen == [signum]
    assert len(rest) == len(loader) - 1
    assert sorted(i for i, pad in entries([first, *rest]) if not pad) == list(range(301))
