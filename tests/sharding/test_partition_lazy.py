"""The lazy elastic resume (EpochRemainder) against the reference path that builds the pool
(remaining_samples + split_pool, in tests/partition_reference.py), and the counter-based
permutations it rests on."""

import importlib
import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from partition_reference import remaining_samples, split_pool

from sharding.partition import (
    EpochRemainder,
    Partition,
    PartitionError,
    Policy,
    Segment,
    VisitOrder,
    entries_per_rank,
    remaining_partition,
)

SHARD_COUNTS = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=20),
    st.lists(st.integers(0, 12), min_size=50, max_size=200),
    st.lists(st.integers(0, 3000), min_size=1, max_size=3),
    st.sampled_from([[1], [0, 1, 0], [0, 0, 2], [5]]),
).filter(lambda counts: sum(counts) > 0)
POLICIES_ST: st.SearchStrategy[Policy] = st.sampled_from(["pad", "drop"])


def scrambled(part: Partition, epoch: int, segment: int, world_size: int, rank: int) -> Partition:
    """A pure visit order that moves every entry, padding included, somewhere else."""
    order = np.random.default_rng([epoch, segment, world_size, rank]).permutation(len(part))
    return Partition(part.indices[order], part.is_pad[order])


def reversed_order(part: Partition, epoch: int, segment: int, world_size: int, rank: int) -> Partition:
    """Padding first: a short block's padding entry is always consumed."""
    return Partition(part.indices[::-1], part.is_pad[::-1])


# The module, not the function `sharding.partition` that the package exports under its name.
partition_module = importlib.import_module("sharding.partition")

VISIT_ORDERS: st.SearchStrategy[VisitOrder | None] = st.sampled_from(
    [None, scrambled, reversed_order]
)


def assert_same(lazy: Partition, reference: Partition) -> None:
    assert np.array_equal(lazy.indices, reference.indices)
    assert np.array_equal(lazy.is_pad, reference.is_pad)


@settings(max_examples=80, deadline=None)
@given(
    SHARD_COUNTS,
    st.lists(st.integers(1, 40), min_size=1, max_size=4),
    st.data(),
    POLICIES_ST,
    st.booleans(),
    VISIT_ORDERS,
)
def test_lazy_resume_is_bit_identical_to_the_reference_over_segments(
    counts: list[int],
    worlds: list[int],
    data: st.DataObject,
    policy: Policy,
    shuffle: bool,
    visit_order: VisitOrder | None,
) -> None:
    assume(policy == "pad" or sum(counts) >= worlds[0])
    segments: list[Segment] = []
    kwargs = {"epoch": 4, "seed": 3, "policy": policy, "shuffle": shuffle}
    for world_size in worlds:
        pool = remaining_samples(counts, segments=segments, visit_order=visit_order, **kwargs)
        remainder = EpochRemainder(counts, segments=segments, visit_order=visit_order, **kwargs)
        assert remainder.num_samples == pool.size
        for rank in range(world_size):
            reference = split_pool(
                pool, segment=len(segments), world_size=world_size, rank=rank, **kwargs
            )
            assert_same(remainder.partition(world_size, rank), reference)
        available = entries_per_rank(pool.size, world_size, policy)
        segments.append(Segment(world_size, data.draw(st.integers(0, available))))


@settings(max_examples=40, deadline=None)
@given(SHARD_COUNTS, st.integers(1, 30), st.integers(1, 30), st.data(), POLICIES_ST)
def test_remaining_partition_matches_the_reference_for_every_rank(
    counts: list[int], old_world: int, new_world: int, data: st.DataObject, policy: Policy
) -> None:
    assume(policy == "pad" or sum(counts) >= old_world)
    available = entries_per_rank(sum(counts), old_world, policy)
    segments = [Segment(old_world, data.draw(st.integers(0, available)))]
    pool = remaining_samples(counts, segments=segments, epoch=1, seed=8, policy=policy)
    for rank in range(new_world):
        lazy = remaining_partition(
            counts, segments=segments, world_size=new_world, rank=rank, epoch=1, seed=8,
            policy=policy,
        )
        reference = split_pool(
            pool, segment=1, world_size=new_world, rank=rank, epoch=1, seed=8, policy=policy
        )
        assert_same(lazy, reference)


def test_a_visit_order_too_short_for_the_consumed_count_is_refused() -> None:
    def half(part: Partition, epoch: int, segment: int, world_size: int, rank: int) -> Partition:
        return Partition(part.indices[: len(part) // 2], part.is_pad[: len(part) // 2])

    with pytest.raises(PartitionError, match="visit order has only"):
        remaining_partition(
            [10, 9], segments=[Segment(2, 9)], world_size=3, rank=0, epoch=0, seed=0,
            visit_order=half,
        )


def count_epoch_positions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many epoch positions each _EpochLayout.take computes."""
    sizes: list[int] = []
    take = partition_module._EpochLayout.take

    def counting(self: partition_module._EpochLayout, positions: np.ndarray) -> np.ndarray:
        sizes.append(int(positions.size))
        return take(self, positions)

    monkeypatch.setattr(partition_module._EpochLayout, "take", counting)
    return sizes


@pytest.mark.parametrize(("old_world", "new_world"), [(1000, 100), (64, 100), (1000, 1000)])
def test_elastic_resume_computes_only_the_old_blocks_the_new_rank_touches(
    monkeypatch: pytest.MonkeyPatch, old_world: int, new_world: int
) -> None:
    counts = np.full(10_000, 100)  # 1M samples
    num_samples = 1_000_000
    consumed = entries_per_rank(num_samples, old_world, "pad") // 3
    sizes = count_epoch_positions(monkeypatch)
    part = remaining_partition(
        counts, segments=[Segment(old_world, consumed)], world_size=new_world, rank=new_world // 2,
        epoch=2, seed=1,
    )
    # Only the new rank's entries are looked up in the epoch order (the old blocks' visiting
    # orders are a cipher of their positions): the pool of ~1M is never built.
    assert 0 < sum(sizes) <= len(part) + 1


def test_elastic_resume_memory_is_the_share_not_the_pool() -> None:
    counts = np.full(20_000, 100)  # 2M samples: the pool alone would be 16 MB of int64
    segments = [Segment(2000, 300), Segment(500, 100)]
    tracemalloc.start()
    try:
        part = remaining_partition(
            counts, segments=segments, world_size=250, rank=17, epoch=0, seed=4
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(part) < 8_000
    # Per-shard arrays (5 x 160 KB), per-block arrays and the share's chunks: well under 4 MB.
    assert peak < 4 * 2**20, peak


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 70_000), st.integers(0, 2**63), st.data())
def test_block_permutation_is_a_bijection_computable_in_pieces(
    length: int, key: int, data: st.DataObject
) -> None:
    keys = partition_module._block_keys((key, 1, 2))
    whole = partition_module._permute_block(np.arange(length, dtype=np.int64), length, keys)
    assert np.array_equal(np.sort(whole), np.arange(length))
    lo = data.draw(st.integers(0, length - 1))
    piece = partition_module._permute_block(np.arange(lo, length, dtype=np.int64), length, keys)
    assert np.array_equal(piece, whole[lo:])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=8), st.integers(0, 2**32))
def test_within_shard_permutations_are_bijections_of_mixed_sizes(
    sizes: list[int], seed: int
) -> None:
    counts = np.asarray(sizes, dtype=np.int64)
    layout = partition_module._EpochLayout(counts, epoch=0, seed=seed, shuffle=True)
    order = layout.take(np.arange(int(counts.sum()), dtype=np.int64))
    assert np.array_equal(np.sort(order), np.arange(int(counts.sum())))
    ends = np.cumsum(counts)
    shard_of = np.searchsorted(ends, order, side="right")
    assert (np.diff(shard_of) != 0).sum() == len(sizes) - 1  # each shard stays contiguous


def shard_split(counts: Sequence[int], epoch: int) -> list[int]:
    """The samples of shard 0 that rank 0 of 2 reads, when shard 0 is cut between the ranks."""
    part = partition_module.partition(counts, world_size=2, rank=0, epoch=epoch, seed=0)
    return sorted(int(i) for i in part.indices if i < counts[0])


def test_a_boundary_shard_splits_differently_each_epoch() -> None:
    counts = [50]  # one shard over two ranks: each epoch, another half of it for rank 0
    assert len({tuple(shard_split(counts, epoch)) for epoch in range(5)}) == 5
