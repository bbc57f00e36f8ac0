"""Which samples each rank reads in one epoch: pure functions of (shard counts, world, rank, epoch,
seed, policy). No I/O, no torch, no environment reads.

Vocabulary (STYLE.md): a *shard* is a file pair on disk, a *partition* is what one rank reads in
one epoch, a *rank* is one training process. A *global index* is a sample's position in the
concatenation of the shards in the order given (shard_counts[0] samples of shard 0 first, ...).

The algorithm, per epoch:

1. Epoch order, independent of the world size: shuffle the shard order (seeded by seed, epoch)
   and the samples inside each shard (seeded by seed, epoch, shard), concatenate. Each shard's
   samples stay contiguous in this order.
2. Split the *pool* (the epoch order, or what a resume left of it, kept in epoch order) into
   world_size contiguous blocks whose sizes differ by at most one:
   block r = pool positions [r*M//W, (r+1)*M//W).
3. Shuffle the block (seeded by seed, epoch, segment, world_size, rank). Policy `drop` removes the
   last visited entry of each long block (floor(M/W) entries per rank, at most W-1 dropped);
   `pad` appends one flagged padding entry to each short block (ceil(M/W) per rank, at most one
   padding entry per rank, fewer than W in all).

Why the epoch order does not depend on the world size: an elastic resume removes what was
consumed from the pool and splits the rest over the new world. Keeping the rest in epoch order
keeps each new block a contiguous run of shards, so a resumed rank still touches about
1/world of the shards; and the consumed set is rebuilt exactly by replaying steps 2-3 per segment.
A loader that visits a rank's entries in another order than step 3 gives (say, batches grouped by
length) passes that order as ``visit_order``, so the replay marks what the rank really consumed.

Locality bound (tested): a rank's real entries come from a contiguous run of the epoch's shard
order, every shard strictly inside the run belongs wholly to that rank, so it touches at most
(shards it owns wholly) + 2 shards, and over all ranks at most num_nonempty_shards + W - 1.
With equal-sized (non-empty) shards that is at most ceil(num_nonempty_shards / W) + 1 per rank.
Shards of very different sizes can make one rank's block span many small shards: the bound
counts samples, not files.

Padding entries point at a real sample so a loader can read something of the right shape: the
sample the rank visited just before (same shard, likely still in the page cache). A rank with no
real sample (more ranks than samples, policy `pad`) gets one padding entry pointing at the first
sample of the next block.
"""

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import numpy as np
import numpy.typing as npt

Policy = Literal["drop", "pad"]
POLICIES: tuple[str, ...] = get_args(Policy)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# Distinct stream tags: the shard-order, within-shard and block shuffles never share a seed.
_TAG_SHARD_ORDER = 0
_TAG_WITHIN_SHARD = 1
_TAG_BLOCK = 2


class PartitionError(ValueError):
    """The inputs admit no valid partition; the message names the value and a fix."""


@dataclass(frozen=True, eq=False)
class Partition:
    """What one rank reads in one epoch (or in what is left of it after a resume)."""

    indices: IntArray  # int64 [n], global sample ids in the order this rank visits them
    is_pad: BoolArray  # bool [n], True for padding entries: read them, mask them out of metrics

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_real(self) -> int:
        """Entries that are real samples (count towards metrics)."""
        return len(self) - int(self.is_pad.sum())

    def tail(self, start: int) -> "Partition":
        """Entries from position `start` on (what is left after `start` were consumed)."""
        return Partition(self.indices[start:], self.is_pad[start:])


# (a rank's entries of one segment, epoch, segment number, world_size, rank) -> the same entries in
# the order that rank visits them (a loader may drop entries it never visits, e.g. drop_last).
# Must be a pure function of its arguments: a resume replays it for every past rank.
VisitOrder = Callable[["Partition", int, int, int, int], "Partition"]


class Segment(NamedTuple):
    """One stretch of an epoch run at one world size; ranks step in lockstep, so one count."""

    world_size: int
    consumed_per_rank: int  # entries (padding included) each rank consumed in this stretch


def validate_shard_counts(shard_counts: Sequence[int] | npt.ArrayLike) -> IntArray:
    """Checked copy of the per-shard sample counts: int64 [num_shards], total >= 1."""
    counts = np.asarray(shard_counts)
    if counts.ndim != 1:
        raise PartitionError(
            f"shard_counts has shape {counts.shape}: pass one sample count per shard (1-D)"
        )
    if counts.size == 0:
        raise PartitionError("shard_counts is empty: the dataset has no shards (check its path)")
    if counts.dtype.kind not in "iu":
        raise PartitionError(
            f"shard_counts has dtype {counts.dtype}: counts must be integers (got e.g. "
            f"{counts[0]!r}); pass ints such as [1000, 1000, 437]"
        )
    if (counts < 0).any():
        bad = int(np.flatnonzero(counts < 0)[0])
        raise PartitionError(
            f"shard_counts[{bad}]={counts[bad]} is negative: a shard holds >= 0 samples"
        )
    if counts.dtype == np.uint64 and counts.max() > np.iinfo(np.int64).max:
        raise PartitionError(f"shard_counts max {counts.max()} does not fit in int64")
    counts = counts.astype(np.int64)  # int64 [S]
    if int(counts.sum()) == 0:
        raise PartitionError(
            f"the dataset is empty: all {counts.size} shards hold 0 samples, nothing to "
            "partition (check that the dataset was written completely)"
        )
    return counts


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_world(world_size: int, rank: int) -> None:
    if not _is_int(world_size) or world_size < 1:
        raise PartitionError(
            f"world_size={world_size!r} is invalid: must be an int >= 1 (the number of ranks)"
        )
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise PartitionError(
            f"rank={rank!r} is invalid for world_size={world_size}: "
            f"must be an int with 0 <= rank <= {world_size - 1}"
        )


def _check_seed_epoch(seed: int, epoch: int) -> None:
    if not _is_int(seed) or seed < 0:
        raise PartitionError(f"seed={seed!r} is invalid: must be an int >= 0 (e.g. seed=0)")
    if not _is_int(epoch) or epoch < 0:
        raise PartitionError(f"epoch={epoch!r} is invalid: must be an int >= 0")


def _check_seed_epoch_policy(seed: int, epoch: int, policy: str) -> None:
    _check_seed_epoch(seed, epoch)
    if policy not in POLICIES:
        raise PartitionError(f"policy={policy!r} is invalid: choose one of {POLICIES}")


def _check_enough_for_drop(num_samples: int, world_size: int, policy: Policy) -> None:
    if policy == "drop" and num_samples < world_size:
        raise PartitionError(
            f"policy='drop' with {num_samples} samples over world_size={world_size} gives every "
            f"rank 0 samples: use policy='pad' (flagged padding) or world_size <= {num_samples}"
        )


def entries_per_rank(num_items: int, world_size: int, policy: Policy) -> int:
    """Entries every rank gets when `num_items` pool samples are split over `world_size`."""
    if policy == "pad":
        return -(-num_items // world_size)
    return num_items // world_size


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def _shard_order(counts: IntArray, *, epoch: int, seed: int, shuffle: bool) -> IntArray:
    """Shard ids in the order the epoch lays them out: int64 [S]."""
    if not shuffle:
        return np.arange(counts.size, dtype=np.int64)
    return _rng(seed, epoch, _TAG_SHARD_ORDER).permutation(counts.size).astype(np.int64)


def _epoch_slice(
    counts: IntArray, start: int, stop: int, *, epoch: int, seed: int, shuffle: bool
) -> IntArray:
    """Global ids at epoch-order positions [start, stop): int64 [stop - start].

    Only the shards overlapping the range are shuffled, so one rank pays for its share only.
    Shuffling inside each shard, not only inside the block, changes every epoch which samples
    of a boundary shard go to which rank (else a shard would split at the same sample).
    """
    order = _shard_order(counts, epoch=epoch, seed=seed, shuffle=shuffle)  # int64 [S]
    first_ids = np.cumsum(counts) - counts  # int64 [S], global id of each shard's first sample
    ordered = counts[order]  # int64 [S], counts in epoch order
    ends = np.cumsum(ordered)  # int64 [S], epoch position just past each shard
    begins = ends - ordered  # int64 [S]
    lo = int(np.searchsorted(ends, start, side="right"))
    hi = int(np.searchsorted(begins, stop, side="left"))
    pieces: list[IntArray] = []
    for j in range(lo, hi):  # loops over shards, never samples
        count, shard = int(ordered[j]), int(order[j])
        if count == 0:
            continue
        if shuffle:
            local = _rng(seed, epoch, _TAG_WITHIN_SHARD, shard).permutation(count)
        else:
            local = np.arange(count, dtype=np.int64)
        cut = local[max(start - int(begins[j]), 0) : min(stop - int(begins[j]), count)]
        pieces.append(cut.astype(np.int64) + first_ids[shard])  # int64 [len(cut)]
    if not pieces:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(pieces)


def epoch_order(
    shard_counts: Sequence[int] | npt.ArrayLike, *, epoch: int, seed: int, shuffle: bool = True
) -> IntArray:
    """All global ids in the epoch's world-size-independent order: int64 [N]."""
    counts = validate_shard_counts(shard_counts)
    _check_seed_epoch(seed, epoch)
    return _epoch_slice(counts, 0, int(counts.sum()), epoch=epoch, seed=seed, shuffle=shuffle)


def _block_bounds(num_items: int, world_size: int, rank: int) -> tuple[int, int]:
    """Pool positions [start, stop) of this rank's block; block sizes differ by at most one."""
    return rank * num_items // world_size, (rank + 1) * num_items // world_size


def _arrange_block(
    block: IntArray, *, num_entries: int, fallback: int, shuffle: bool, block_key: tuple[int, ...]
) -> Partition:
    """The rank's visiting order of its block (int64 [b]) cut or padded to num_entries.

    The shuffle's swaps depend only on the block length and key, not on the values, so the
    fast path (one rank) and the resume path (all ranks of a past segment) agree exactly.
    """
    values = block.astype(np.int64, copy=True)  # int64 [b], b within 1 of num_entries
    if shuffle:
        _rng(*block_key, _TAG_BLOCK).shuffle(values)
    values = values[:num_entries]  # drop: a long block loses its last visited entry
    is_pad = np.zeros(num_entries, dtype=np.bool_)  # bool [n]
    if values.size < num_entries:  # pad: a short block gets one flagged entry
        values = np.append(values, values[-1] if values.size else np.int64(fallback))
        is_pad[-1] = True
    values.setflags(write=False)  # shared by the sampler's views: nobody may edit them
    is_pad.setflags(write=False)
    return Partition(values, is_pad)


def _block_key(seed: int, epoch: int, segment: int, world_size: int, rank: int) -> tuple[int, ...]:
    return (seed, epoch, segment, world_size, rank)


def partition(
    shard_counts: Sequence[int] | npt.ArrayLike,
    *,
    world_size: int,
    rank: int,
    epoch: int,
    seed: int,
    policy: Policy = "pad",
    shuffle: bool = True,
) -> Partition:
    """This rank's entries for the whole epoch; every rank gets the same number.

    `pad`: ceil(N/W) entries, every sample exactly once over all ranks plus < W flagged padding
    entries (at most one per rank; a rank with no real sample gets only padding). `drop`:
    floor(N/W) entries, no sample twice, at most W-1 samples left out; raises PartitionError if
    N < W. With shuffle=False the rank visits its block in natural global order.
    """
    counts = validate_shard_counts(shard_counts)
    _check_world(world_size, rank)
    _check_seed_epoch_policy(seed, epoch, policy)
    num_samples = int(counts.sum())
    _check_enough_for_drop(num_samples, world_size, policy)
    start, stop = _block_bounds(num_samples, world_size, rank)
    block = _epoch_slice(counts, start, stop, epoch=epoch, seed=seed, shuffle=shuffle)  # [b]
    fallback = 0
    if start == stop:  # more ranks than samples: pad with the next block's first sample
        at = min(start, num_samples - 1)
        fallback = int(_epoch_slice(counts, at, at + 1, epoch=epoch, seed=seed, shuffle=shuffle)[0])
    return _arrange_block(
        block,
        num_entries=entries_per_rank(num_samples, world_size, policy),
        fallback=fallback,
        shuffle=shuffle,
        block_key=_block_key(seed, epoch, 0, world_size, rank),
    )


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
    is split over world_size ranks as stretch number `segment` of the epoch.

    remaining_partition is remaining_samples + split_pool; call the two yourself to split one
    pool for many ranks without rebuilding it per rank.
    """
    ids = np.asarray(pool, dtype=np.int64)  # int64 [M]
    _check_world(world_size, rank)
    _check_seed_epoch_policy(seed, epoch, policy)
    start, stop = _block_bounds(ids.size, world_size, rank)
    return _arrange_block(
        ids[start:stop],
        num_entries=entries_per_rank(ids.size, world_size, policy),
        fallback=int(ids[min(start, ids.size - 1)]) if ids.size else 0,
        shuffle=shuffle,
        block_key=_block_key(seed, epoch, segment, world_size, rank),
    )


def _check_segment(index: int, segment: Segment, num_items: int, policy: Policy) -> None:
    world_size, consumed = segment
    if not _is_int(world_size) or world_size < 1:
        raise PartitionError(f"segments[{index}] has world_size={world_size!r}: must be >= 1")
    available = entries_per_rank(num_items, world_size, policy)
    if not _is_int(consumed) or not 0 <= consumed <= available:
        raise PartitionError(
            f"segments[{index}] has consumed_per_rank={consumed!r}, but its {world_size} ranks "
            f"had {available} entries each: the state was saved for other shard counts, seed "
            "or policy (resume with the same ones, or start the epoch fresh)"
        )


def _consume_segment(
    pool: IntArray,
    taken: BoolArray,
    index: int,
    segment: Segment,
    *,
    epoch: int,
    seed: int,
    policy: Policy,
    shuffle: bool,
    visit_order: VisitOrder | None = None,
) -> IntArray:
    """The pool (int64 [M]) minus the real samples every rank consumed in `segment`.

    `taken` (bool [N], by global id) is scratch space, updated in place. A rank consumed the
    first `consumed` entries of its part, in `visit_order` when one is given.
    """
    _check_segment(index, segment, pool.size, policy)
    world_size, consumed = int(segment[0]), int(segment[1])
    if consumed == 0:
        return pool
    for rank in range(world_size):  # loops over ranks, never samples
        part = split_pool(
            pool,
            segment=index,
            world_size=world_size,
            rank=rank,
            epoch=epoch,
            seed=seed,
            policy=policy,
            shuffle=shuffle,
        )
        if visit_order is not None:
            part = visit_order(part, epoch, index, world_size, rank)
            if len(part) < consumed:
                raise PartitionError(
                    f"segments[{index}] has consumed_per_rank={consumed}, but rank {rank}'s visit "
                    f"order has only {len(part)} entries: the state was saved with another loader "
                    "(batch size, grouping); resume with the same one, or start the epoch fresh"
                )
        taken[part.indices[:consumed][~part.is_pad[:consumed]]] = True
    return pool[~taken[pool]]  # int64 [M'], still in epoch order


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
    counts = validate_shard_counts(shard_counts)
    _check_seed_epoch_policy(seed, epoch, policy)
    num_samples = int(counts.sum())
    pool = _epoch_slice(counts, 0, num_samples, epoch=epoch, seed=seed, shuffle=shuffle)
    if segments:
        _check_enough_for_drop(num_samples, int(segments[0][0]), policy)
    taken = np.zeros(num_samples, dtype=np.bool_)  # bool [N], by global id
    for index, segment in enumerate(segments):
        pool = _consume_segment(
            pool,
            taken,
            index,
            Segment(*segment),
            epoch=epoch,
            seed=seed,
            policy=policy,
            shuffle=shuffle,
            visit_order=visit_order,
        )
    return pool


def remaining_partition(
    shard_counts: Sequence[int] | npt.ArrayLike,
    *,
    segments: Sequence[Segment | tuple[int, int]],
    world_size: int,
    rank: int,
    epoch: int,
    seed: int,
    policy: Policy = "pad",
    shuffle: bool = True,
    visit_order: VisitOrder | None = None,
) -> Partition:
    """This rank's entries for what is left of the epoch after `segments`, over a new world.

    The remaining samples (see remaining_samples) are split like a fresh epoch: equal counts,
    each remaining sample once under `pad` (plus < W flagged padding), at most W-1 left out under
    `drop`. Nothing remaining gives every rank 0 entries; so does `drop` with fewer remaining
    samples than ranks (they are the at most W-1 left out). With no segments this is
    partition(). The split is segment number len(segments), so it never repeats an earlier one.
    The result is in partition order; `visit_order` only says how past segments were visited.
    """
    if not segments:
        return partition(
            shard_counts,
            world_size=world_size,
            rank=rank,
            epoch=epoch,
            seed=seed,
            policy=policy,
            shuffle=shuffle,
        )
    _check_world(world_size, rank)
    pool = remaining_samples(
        shard_counts, segments=segments, epoch=epoch, seed=seed, policy=policy, shuffle=shuffle,
        visit_order=visit_order,
    )  # int64 [M]
    return split_pool(
        pool,
        segment=len(segments),
        world_size=world_size,
        rank=rank,
        epoch=epoch,
        seed=seed,
        policy=policy,
        shuffle=shuffle,
    )


def locate(
    indices: npt.ArrayLike, shard_counts: Sequence[int] | npt.ArrayLike
) -> tuple[IntArray, IntArray]:
    """(shard id, index within shard) of each global id: (int64 [n], int64 [n])."""
    counts = validate_shard_counts(shard_counts)
    ids = np.asarray(indices, dtype=np.int64)  # int64 [n]
    num_samples = int(counts.sum())
    if ids.size and (ids.min() < 0 or ids.max() >= num_samples):
        bad = int(ids[(ids < 0) | (ids >= num_samples)][0])
        raise PartitionError(
            f"global index {bad} is outside [0, {num_samples}): decode sampler values "
            "(negative = padding) with sharding.sampler.decode_array first"
        )
    ends = np.cumsum(counts)  # int64 [S]
    shards = np.searchsorted(ends, ids, side="right").astype(np.int64)  # int64 [n]
    return shards, ids - (ends[shards] - counts[shards])
