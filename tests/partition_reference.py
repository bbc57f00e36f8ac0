"""The reference path of sharding.partition, for tests only: it builds the whole epoch order and
replays every past rank, O(N) per call, where EpochRemainder computes one rank's share without it.

Written as plainly as possible, so the lazy path (chunked, block by block, segment by segment) is
checked against something that visibly does what partition.py's module docstring says. It shares
only the permutations with sharding.partition (the epoch layout and the block cipher), the parts
that define the order rather than compute it.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from sharding.partition import (
    IntArray,
    Partition,
    Policy,
    Segment,
    VisitOrder,
    _block_keys,
    _EpochLayout,
    _permute_block,
    entries_per_rank,
    validate_shard_counts,
)


def epoch_order(
    shard_counts: Sequence[int] | npt.ArrayLike, *, epoch: int, seed: int, shuffle: bool = True
) -> IntArray:
    """All global ids in the epoch's world-size-independent order: int64 [N]."""
    layout = _EpochLayout(validate_shard_counts(shard_counts), epoch=epoch, seed=seed, shuffle=shuffle)
    return layout.take(np.arange(layout.num_samples, dtype=np.int64))


def split_pool(
    pool: npt.ArrayLike,
    *,
    segment: int,
    world_size: int,
    rank: int,
    epoch: int,
    seed: int,
    policy: Policy = "pad",
    shuffle: bool = True,
) -> Partition:
    """Rank's entries when `pool` (global ids in epoch order, as remaining_samples returns them)
    is split over world_size ranks as stretch number `segment` of the epoch."""
    ids = np.asarray(pool, dtype=np.int64)  # int64 [M]
    start, stop = rank * ids.size // world_size, (rank + 1) * ids.size // world_size
    block = ids[start:stop]  # int64 [b], in pool order
    if shuffle and block.size:  # block entry q is visited at position P(q)
        keys = _block_keys((seed, epoch, segment, world_size, rank))
        visited = np.empty_like(block)
        visited[_permute_block(np.arange(block.size, dtype=np.int64), block.size, keys)] = block
        block = visited  # int64 [b], in visiting order
    num_entries = entries_per_rank(ids.size, world_size, policy)
    indices = block[:num_entries]  # drop: a long block loses its last visited entry
    is_pad = np.zeros(num_entries, dtype=np.bool_)  # bool [n]
    if indices.size < num_entries:  # pad: a short block gets one flagged entry
        fallback = indices[-1] if indices.size else ids[min(start, ids.size - 1)]
        indices = np.append(indices, fallback)
        is_pad[-1] = True
    return Partition(indices, is_pad)


def remaining_samples(
    shard_counts: Sequence[int] | npt.ArrayLike,
    *,
    segments: Sequence[Segment | tuple[int, int]],
    epoch: int,
    seed: int,
    policy: Policy = "pad",
    shuffle: bool = True,
    visit_order: VisitOrder | None = None,
) -> IntArray:
    """Samples of the epoch not consumed in `segments`, in epoch order: int64 [M].

    Under `drop`, samples a segment left out but never visited are not consumed: they remain.
    `visit_order`: how the ranks visited their entries, when not in partition order.
    """
    counts = validate_shard_counts(shard_counts)  # int64 [S]
    pool = epoch_order(counts, epoch=epoch, seed=seed, shuffle=shuffle)  # int64 [N]
    taken = np.zeros(pool.size, dtype=np.bool_)  # bool [N], by global id
    for index, (world_size, consumed) in enumerate(segments):
        for rank in range(world_size):
            part = split_pool(pool, segment=index, world_size=world_size, rank=rank, epoch=epoch,
                              seed=seed, policy=policy, shuffle=shuffle)
            if visit_order is not None:
                part = visit_order(part, epoch, index, world_size, rank)
            taken[part.indices[:consumed][~part.is_pad[:consumed]]] = True
        pool = pool[~taken[pool]]  # int64 [M'], still in epoch order
    return pool


def locate(
    indices: npt.ArrayLike, shard_counts: Sequence[int] | npt.ArrayLike
) -> tuple[IntArray, IntArray]:
    """(shard id, index within shard) of each global id: (int64 [n], int64 [n])."""
    counts = validate_shard_counts(shard_counts)  # int64 [S]
    ids = np.asarray(indices, dtype=np.int64)  # int64 [n]
    ends = np.cumsum(counts)  # int64 [S]
    shards = np.searchsorted(ends, ids, side="right").astype(np.int64)  # int64 [n]
    return shards, ids - (ends[shards] - counts[shards])
