"""The epoch order of sampler state version 1 (Switchyard before the counter-based shuffles), kept
so a checkpoint saved mid-epoch by an older Switchyard finishes that epoch exactly.

Version 1 drew the within-shard and block shuffles from a numpy Generator per shard and per
block; version 2 (partition.py) draws the same kinds of permutation from a keyed Feistel network,
so the guarantees are the same and the order is not. A version-1 state names samples of the
version-1 order: the sampler finishes that one epoch with :class:`RemainderV1`, then starts the
next in version 2's order. The shard order (step 1 of partition.py's algorithm), the block split
and the drop/pad rules are unchanged and shared.

Cost, as in version 1: the whole epoch order is built and every past rank replayed, O(N) per
rank once at the resume (30-40 s and 1.7 GB on 100M samples). It is paid only by a run resumed
mid-epoch from a checkpoint written before the change.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from sharding.partition import (
    _TAG_BLOCK,
    _TAG_WITHIN_SHARD,
    IntArray,
    Partition,
    Policy,
    Segment,
    VisitOrder,
    _block_bounds,
    _block_key,
    _check_enough_for_drop,
    _check_seed_epoch_policy,
    _check_world,
    _rng,
    _shard_order,
    entries_per_rank,
    replay_segments,
    validate_shard_counts,
)


def epoch_order_v1(counts: IntArray, *, epoch: int, seed: int, shuffle: bool) -> IntArray:
    """All global ids in version 1's epoch order: int64 [N]. counts: validated, int64 [S]."""
    order = _shard_order(counts, epoch=epoch, seed=seed, shuffle=shuffle)  # int64 [S]
    first_ids = np.cumsum(counts) - counts  # int64 [S], global id of each shard's first sample
    pieces: list[IntArray] = []
    for shard in order.tolist():  # loops over shards, never samples
        count = int(counts[shard])
        if count == 0:
            continue
        if shuffle:
            local = _rng(seed, epoch, _TAG_WITHIN_SHARD, shard).permutation(count)
        else:
            local = np.arange(count, dtype=np.int64)
        pieces.append(local.astype(np.int64) + first_ids[shard])
    return np.concatenate(pieces)


def split_pool_v1(
    pool: IntArray, *, segment: int, world_size: int, rank: int, epoch: int, seed: int,
    policy: Policy, shuffle: bool,
) -> Partition:
    """Rank's entries of `pool` (int64 [M], epoch order) split as stretch `segment`, version 1."""
    start, stop = _block_bounds(pool.size, world_size, rank)
    num_entries = entries_per_rank(pool.size, world_size, policy)
    values = pool[start:stop].copy()  # int64 [b]
    if shuffle:
        _rng(*_block_key(seed, epoch, segment, world_size, rank), _TAG_BLOCK).shuffle(values)
    values = values[:num_entries]  # drop: a long block loses its last visited entry
    is_pad = np.zeros(num_entries, dtype=np.bool_)  # bool [n]
    if values.size < num_entries:  # pad: a short block gets one flagged entry
        fallback = pool[min(start, pool.size - 1)] if pool.size else np.int64(0)
        values = np.append(values, values[-1] if values.size else fallback)
        is_pad[-1] = True
    values.setflags(write=False)
    is_pad.setflags(write=False)
    return Partition(values, is_pad)


class RemainderV1:
    """What is left of an epoch after `segments`, in version 1's order; the interface of
    partition.EpochRemainder (num_samples, entries_per_rank, check_split, partition)."""

    def __init__(
        self,
        shard_counts: Sequence[int] | npt.ArrayLike,
        *,
        segments: Sequence[Segment | tuple[int, int]],
        epoch: int,
        seed: int,
        policy: Policy = "pad",
        shuffle: bool = True,
        visit_order: VisitOrder | None = None,
    ) -> None:
        counts = validate_shard_counts(shard_counts)
        _check_seed_epoch_policy(seed, epoch, policy)
        self.epoch, self.seed, self.policy, self.shuffle = epoch, seed, policy, shuffle
        self._segment = len(segments)  # the split of what is left is the next stretch
        self._pool = replay_segments(  # int64 [M], still in epoch order
            epoch_order_v1(counts, epoch=epoch, seed=seed, shuffle=shuffle), segments, epoch=epoch,
            seed=seed, policy=policy, shuffle=shuffle, visit_order=visit_order, split=split_pool_v1)
        self.num_samples = int(self._pool.size)

    def entries_per_rank(self, world_size: int) -> int:
        return entries_per_rank(self.num_samples, world_size, self.policy)

    def check_split(self, world_size: int, rank: int) -> None:
        _check_world(world_size, rank)
        if self._segment == 0:
            _check_enough_for_drop(self.num_samples, world_size, self.policy)

    def partition(self, world_size: int, rank: int) -> Partition:
        self.check_split(world_size, rank)
        return split_pool_v1(self._pool, segment=self._segment, world_size=world_size, rank=rank,
                             epoch=self.epoch, seed=self.seed, policy=self.policy,
                             shuffle=self.shuffle)
