"""Properties of sharding.partition over random shard counts and world sizes 1..256."""

import importlib
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from partition_reference import epoch_order, locate, remaining_samples, split_pool

from sharding.partition import (
    Partition,
    PartitionError,
    Policy,
    Segment,
    entries_per_rank,
    partition,
    remaining_partition,
)

# Small shards with zeros, many shards, a few big shards, and the degenerate cases.
SHARD_COUNTS = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=20),
    st.lists(st.integers(0, 12), min_size=50, max_size=300),
    st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    st.sampled_from([[1], [0, 1, 0], [0, 0, 2], [5]]),
).filter(lambda counts: sum(counts) > 0)
WORLD_SIZES = st.integers(1, 256)
SEEDS = st.integers(0, 2**32)
EPOCHS = st.integers(0, 1000)
POLICIES_ST: st.SearchStrategy[Policy] = st.sampled_from(["pad", "drop"])
FAST = settings(max_examples=60, deadline=None)


def all_ranks(
    counts: Sequence[int],
    world_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    policy: Policy = "pad",
    shuffle: bool = True,
) -> list[Partition]:
    return [
        partition(
            counts,
            world_size=world_size,
            rank=rank,
            epoch=epoch,
            seed=seed,
            policy=policy,
            shuffle=shuffle,
        )
        for rank in range(world_size)
    ]


def real_ids(parts: Sequence[Partition]) -> np.ndarray:
    """Real (non-padding) global ids of all ranks: int64 [total real]."""
    return np.concatenate([p.indices[~p.is_pad] for p in parts])


def consumed_ids(parts: Sequence[Partition], consumed: int) -> np.ndarray:
    """Real ids in the first `consumed` entries of every rank: int64 [k]."""
    return np.concatenate([p.indices[:consumed][~p.is_pad[:consumed]] for p in parts])


def split_all(
    counts: Sequence[int],
    segments: Sequence[Segment],
    world_size: int,
    *,
    seed: int,
    epoch: int,
    policy: Policy,
) -> list[Partition]:
    pool = remaining_samples(counts, segments=segments, epoch=epoch, seed=seed, policy=policy)
    return [
        split_pool(
            pool,
            segment=len(segments),
            world_size=world_size,
            rank=rank,
            epoch=epoch,
            seed=seed,
            policy=policy,
        )
        for rank in range(world_size)
    ]


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, SEEDS, EPOCHS)
def test_pad_gives_equal_counts_and_every_sample_exactly_once(
    counts: list[int], world_size: int, seed: int, epoch: int
) -> None:
    num_samples = sum(counts)
    parts = all_ranks(counts, world_size, epoch=epoch, seed=seed)
    per_rank = math.ceil(num_samples / world_size)
    assert {len(p) for p in parts} == {per_rank}
    assert np.array_equal(np.sort(real_ids(parts)), np.arange(num_samples))
    pads = [int(p.is_pad.sum()) for p in parts]
    assert sum(pads) == per_rank * world_size - num_samples < world_size
    for part, num_pads in zip(parts, pads, strict=True):
        assert num_pads <= 1
        if num_pads:
            assert part.is_pad[-1]  # padding comes last
            pad_id = int(part.indices[-1])
            assert 0 <= pad_id < num_samples
            if part.num_real:  # points at a sample the rank already reads
                assert pad_id in set(part.indices[:-1].tolist())


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, SEEDS, EPOCHS)
def test_drop_gives_equal_counts_never_repeats_and_drops_under_world_size(
    counts: list[int], world_size: int, seed: int, epoch: int
) -> None:
    num_samples = sum(counts)
    if num_samples < world_size:
        with pytest.raises(PartitionError, match="policy='pad'"):
            partition(counts, world_size=world_size, rank=0, epoch=epoch, seed=seed, policy="drop")
        return
    parts = all_ranks(counts, world_size, epoch=epoch, seed=seed, policy="drop")
    assert {len(p) for p in parts} == {num_samples // world_size}
    assert not any(p.is_pad.any() for p in parts)
    ids = real_ids(parts)
    assert np.unique(ids).size == ids.size
    assert num_samples - ids.size <= world_size - 1


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, st.data(), SEEDS, EPOCHS, POLICIES_ST)
def test_partition_is_deterministic_per_seed_and_epoch(
    counts: list[int],
    world_size: int,
    data: st.DataObject,
    seed: int,
    epoch: int,
    policy: Policy,
) -> None:
    assume(policy == "pad" or sum(counts) >= world_size)
    rank = data.draw(st.integers(0, world_size - 1))
    kwargs = {"world_size": world_size, "rank": rank, "epoch": epoch, "seed": seed}
    first = partition(counts, policy=policy, **kwargs)
    again = partition(list(counts), policy=policy, **kwargs)
    assert np.array_equal(first.indices, again.indices)
    assert np.array_equal(first.is_pad, again.is_pad)


@FAST
@given(SHARD_COUNTS, st.integers(1, 64), SEEDS, EPOCHS)
def test_different_epochs_give_a_different_order(
    counts: list[int], world_size: int, seed: int, epoch: int
) -> None:
    # With >= 20 samples, an identical layout has probability < 1 / (20! / ...) ~ 1e-9.
    assume(sum(counts) >= 20)
    this = all_ranks(counts, world_size, epoch=epoch, seed=seed)
    after = all_ranks(counts, world_size, epoch=epoch + 1, seed=seed)
    this_ids = np.concatenate([p.indices for p in this])
    after_ids = np.concatenate([p.indices for p in after])
    assert not np.array_equal(this_ids, after_ids)
    other_seed = all_ranks(counts, world_size, epoch=epoch, seed=seed + 1)
    assert not np.array_equal(this_ids, np.concatenate([p.indices for p in other_seed]))


def test_drop_leaves_out_different_samples_each_epoch() -> None:
    counts = [100] * 7  # 700 samples over 3 ranks: 1 left out per epoch
    left_out = set()
    for epoch in range(8):
        parts = all_ranks(counts, 3, epoch=epoch, seed=0, policy="drop")
        missing = np.setdiff1d(np.arange(700), real_ids(parts))
        assert missing.size == 1
        left_out.add(int(missing[0]))
    assert len(left_out) > 1


def epoch_shard_runs(counts: Sequence[int], *, epoch: int, seed: int) -> list[int]:
    """Shard ids in the epoch's layout order (one entry per non-empty shard)."""
    shards, _ = locate(epoch_order(counts, epoch=epoch, seed=seed), counts)
    starts = np.flatnonzero(np.diff(shards, prepend=-1))
    return [int(s) for s in shards[starts]]


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, SEEDS, EPOCHS, POLICIES_ST)
def test_each_rank_reads_one_contiguous_block_of_the_epoch_order(
    counts: list[int], world_size: int, seed: int, epoch: int, policy: Policy
) -> None:
    """Blocks are contiguous in epoch order (drop: minus at most one) and ordered by rank."""
    assume(policy == "pad" or sum(counts) >= world_size)
    order = epoch_order(counts, epoch=epoch, seed=seed)  # int64 [N]
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    assert sorted(epoch_shard_runs(counts, epoch=epoch, seed=seed)) == [
        i for i, c in enumerate(counts) if c
    ]  # each shard's samples stay together in the epoch order
    previous_end = -1
    for part in all_ranks(counts, world_size, epoch=epoch, seed=seed, policy=policy):
        if part.num_real == 0:
            continue
        spots = np.sort(position[part.indices[~part.is_pad]])
        holes = int(spots[-1] - spots[0] + 1) - spots.size
        assert holes == 0 if policy == "pad" else holes <= 1
        assert spots[0] > previous_end
        previous_end = int(spots[-1])


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, SEEDS, EPOCHS, POLICIES_ST)
def test_a_rank_touches_at_most_its_wholly_owned_shards_plus_two(
    counts: list[int], world_size: int, seed: int, epoch: int, policy: Policy
) -> None:
    """Locality: touched <= wholly owned + 2 per rank (pad), <= nonempty + W - 1 in all."""
    assume(policy == "pad" or sum(counts) >= world_size)
    num_nonempty = sum(1 for c in counts if c)
    total_touched = 0
    for part in all_ranks(counts, world_size, epoch=epoch, seed=seed, policy=policy):
        shards, _ = locate(part.indices, counts)  # padding included: it opens no new shard
        touched = np.unique(shards)
        total_touched += touched.size if part.num_real else 0
        if policy == "pad" and part.num_real:
            real, taken = np.unique(shards[~part.is_pad], return_counts=True)
            assert np.array_equal(real, touched)
            wholly_owned = int((taken == np.asarray(counts)[real]).sum())
            assert touched.size <= wholly_owned + 2
    assert total_touched <= num_nonempty + world_size - 1


@FAST
@given(
    st.integers(1, 40),
    st.integers(1, 400),
    st.lists(st.booleans(), max_size=400),
    WORLD_SIZES,
    SEEDS,
    EPOCHS,
    POLICIES_ST,
)
def test_equal_sized_shards_touch_at_most_ceil_shards_over_world_plus_one(
    size: int,
    num_shards: int,
    empties: list[bool],
    world_size: int,
    seed: int,
    epoch: int,
    policy: Policy,
) -> None:
    counts = [0 if i < len(empties) and empties[i] else size for i in range(num_shards)]
    num_nonempty = sum(1 for c in counts if c)
    assume(num_nonempty > 0 and (policy == "pad" or num_nonempty * size >= world_size))
    bound = max(1, math.ceil(num_nonempty / world_size) + 1)
    for part in all_ranks(counts, world_size, epoch=epoch, seed=seed, policy=policy):
        shards, _ = locate(part.indices, counts)  # padding included: it opens no new shard
        assert np.unique(shards).size <= bound


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, POLICIES_ST)
def test_unshuffled_ranks_read_their_block_in_natural_order(
    counts: list[int], world_size: int, policy: Policy
) -> None:
    num_samples = sum(counts)
    assume(policy == "pad" or num_samples >= world_size)
    parts = all_ranks(counts, world_size, epoch=3, seed=9, policy=policy, shuffle=False)
    for part in parts:
        real = part.indices[~part.is_pad]
        if real.size:
            assert np.array_equal(real, np.arange(real[0], real[0] + real.size))
    assert np.array_equal(real_ids(parts), np.sort(real_ids(parts)))
    if policy == "pad":
        assert np.array_equal(real_ids(parts), np.arange(num_samples))


@FAST
@given(SHARD_COUNTS, WORLD_SIZES, WORLD_SIZES, st.data(), SEEDS, POLICIES_ST)
def test_elastic_resume_covers_each_remaining_sample_once_with_equal_counts(
    counts: list[int],
    old_world: int,
    new_world: int,
    data: st.DataObject,
    seed: int,
    policy: Policy,
) -> None:
    num_samples = sum(counts)
    assume(policy == "pad" or num_samples >= old_world)
    before = all_ranks(counts, old_world, epoch=2, seed=seed, policy=policy)
    consumed = data.draw(st.integers(0, len(before[0])), label="consumed_per_rank")
    segments = [Segment(old_world, consumed)]
    after = split_all(counts, segments, new_world, seed=seed, epoch=2, policy=policy)
    seen = consumed_ids(before, consumed)
    left = np.setdiff1d(np.arange(num_samples), seen)
    assert {len(p) for p in after} == {entries_per_rank(left.size, new_world, policy)}
    resumed = real_ids(after)
    both = np.concatenate([seen, resumed])
    assert np.unique(both).size == both.size  # nothing twice
    if policy == "pad":
        assert np.array_equal(np.sort(resumed), left)
    else:
        assert left.size - resumed.size <= new_world - 1
    rank = data.draw(st.integers(0, new_world - 1), label="rank")
    direct = remaining_partition(
        counts,
        segments=segments,
        world_size=new_world,
        rank=rank,
        epoch=2,
        seed=seed,
        policy=policy,
    )
    assert np.array_equal(direct.indices, after[rank].indices)
    assert np.array_equal(direct.is_pad, after[rank].is_pad)


@settings(max_examples=40, deadline=None)
@given(SHARD_COUNTS, st.lists(WORLD_SIZES, min_size=2, max_size=4), st.data(), POLICIES_ST)
def test_chained_elastic_resumes_cover_each_sample_once(
    counts: list[int], worlds: list[int], data: st.DataObject, policy: Policy
) -> None:
    num_samples = sum(counts)
    assume(policy == "pad" or num_samples >= worlds[0])
    segments: list[Segment] = []
    seen: list[np.ndarray] = []
    for world_size in worlds[:-1]:
        parts = split_all(counts, segments, world_size, seed=5, epoch=1, policy=policy)
        consumed = data.draw(st.integers(0, len(parts[0])))
        seen.append(consumed_ids(parts, consumed))
        segments.append(Segment(world_size, consumed))
    last = split_all(counts, segments, worlds[-1], seed=5, epoch=1, policy=policy)
    assert len({len(p) for p in last}) == 1
    everything = np.concatenate([*seen, real_ids(last)])
    assert np.unique(everything).size == everything.size
    if policy == "pad":
        assert everything.size == num_samples
    else:
        assert num_samples - everything.size <= worlds[-1] - 1


def test_remaining_partition_without_segments_is_the_partition() -> None:
    counts = [7, 0, 13, 2]
    for rank in range(3):
        fresh = partition(counts, world_size=3, rank=rank, epoch=4, seed=1)
        resumed = remaining_partition(counts, segments=[], world_size=3, rank=rank, epoch=4, seed=1)
        assert np.array_equal(fresh.indices, resumed.indices)


def test_the_first_split_of_remaining_samples_is_the_partition() -> None:
    counts = [30, 1, 0, 44, 9]
    pool = remaining_samples(counts, segments=[], epoch=6, seed=2)
    assert np.array_equal(pool, epoch_order(counts, epoch=6, seed=2))
    for policy in ("pad", "drop"):
        for rank in range(7):
            fresh = partition(counts, world_size=7, rank=rank, epoch=6, seed=2, policy=policy)
            split = split_pool(
                pool, segment=0, world_size=7, rank=rank, epoch=6, seed=2, policy=policy
            )
            assert np.array_equal(fresh.indices, split.indices)
            assert np.array_equal(fresh.is_pad, split.is_pad)


def test_more_ranks_than_samples_pads_idle_ranks_with_flagged_entries() -> None:
    parts = all_ranks([0, 2, 0, 1], 8)
    assert [len(p) for p in parts] == [1] * 8
    assert sum(p.num_real for p in parts) == 3
    assert all(p.is_pad.all() for p in parts if p.num_real == 0)


def test_a_single_sample_over_many_ranks() -> None:
    parts = all_ranks([0, 1], 256)
    assert sum(p.num_real for p in parts) == 1
    assert {int(p.indices[0]) for p in parts} == {0}


def test_an_epoch_fully_consumed_leaves_nothing() -> None:
    counts = [10, 10]
    segments = [Segment(4, 5)]
    assert remaining_samples(counts, segments=segments, epoch=0, seed=0).size == 0
    after = remaining_partition(counts, segments=segments, world_size=3, rank=1, epoch=0, seed=0)
    assert len(after) == 0


def test_the_reference_locate_maps_global_ids_to_shard_and_offset() -> None:
    """The locality tests above count shards with it."""
    shards, local = locate([0, 2, 3, 9], [3, 0, 5, 2])
    assert shards.tolist() == [0, 0, 2, 3]
    assert local.tolist() == [0, 2, 0, 1]


@pytest.mark.parametrize(
    ("counts", "kwargs", "message"),
    [
        ([], {}, "no shards"),
        ([0, 0], {}, "dataset is empty"),
        ([3, -1], {}, r"shard_counts\[1\]=-1"),
        ([1.5, 2], {}, "must be integers"),
        ([[1, 2]], {}, "1-D"),
        ([5], {"world_size": 0}, "world_size=0"),
        ([5], {"rank": 2}, "rank=2"),
        ([5], {"rank": -1}, "rank=-1"),
        ([5], {"seed": -3}, "seed=-3"),
        ([5], {"epoch": -1}, "epoch=-1"),
        ([5], {"policy": "repeat"}, "policy='repeat'"),
        ([1, 0], {"policy": "drop"}, "use policy='pad'"),
    ],
)
def test_bad_inputs_raise_errors_that_name_the_value(
    counts: list[int], kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"world_size": 2, "rank": 0, "epoch": 0, "seed": 0}
    arguments.update(kwargs)
    with pytest.raises(PartitionError, match=message):
        partition(counts, **arguments)  # type: ignore[arg-type]


def test_a_segment_that_does_not_fit_is_rejected() -> None:
    with pytest.raises(PartitionError, match="consumed_per_rank=9"):
        remaining_partition([10], segments=[Segment(2, 9)], world_size=2, rank=0, epoch=0, seed=0)


def test_one_rank_builds_no_generator_per_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The within-shard and block shuffles are counter-based: one Generator per epoch (the shard
    order), never one per shard (28 us each: 3.6 s for a rank of 125,000 shards)."""
    module = importlib.import_module("sharding.partition")  # the package exports a function
    made: list[tuple[int, ...]] = []
    rng = module._rng

    def counting(*key: int) -> np.random.Generator:
        made.append(key)
        return rng(*key)

    monkeypatch.setattr(module, "_rng", counting)
    part = partition(np.full(1000, 10_000), world_size=8, rank=3, epoch=1, seed=0)
    assert len(part) == 1_250_000
    assert len(made) == 1
