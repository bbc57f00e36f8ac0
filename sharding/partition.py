"""Which samples each rank reads in one epoch: pure functions of (shard counts, world, rank, epoch,
seed, policy). No I/O, no torch, no environment reads.

Vocabulary (STYLE.md): a *shard* is a file pair on disk, a *partition* is what one rank reads in
one epoch, a *rank* is one training process. A *global index* is a sample's position in the
concatenation of the shards in the order given (shard_counts[0] samples of shard 0 first, ...).

The algorithm, per epoch:

1. Epoch order, independent of the world size: shuffle the shard order (seeded by seed, epoch)
   and the samples inside each shard (a keyed bijection per (seed, epoch, shard)), concatenate.
   Each shard's samples stay contiguous in this order.
2. Split the *pool* (the epoch order, or what a resume left of it, kept in epoch order) into
   world_size contiguous blocks whose sizes differ by at most one:
   block r = pool positions [r*M//W, (r+1)*M//W).
3. Shuffle the block (a keyed bijection per (seed, epoch, segment, world_size, rank)). Policy
   `drop` removes the last visited entry of each long block (floor(M/W) entries per rank, at
   most W-1 dropped); `pad` appends one flagged padding entry to each short block (ceil(M/W)
   per rank, at most one padding entry per rank, fewer than W in all).

Why the epoch order does not depend on the world size: an elastic resume removes what was
consumed from the pool and splits the rest over the new world. Keeping the rest in epoch order
keeps each new block a contiguous run of shards, so a resumed rank still touches about
1/world of the shards; and the consumed set is rebuilt exactly by replaying steps 2-3 per segment.
A loader that visits a rank's entries in another order than step 3 gives (say, batches grouped by
length) passes that order as ``visit_order``, so the replay marks what the rank really consumed.

Cost: the shuffles are counter-based (a keyed Feistel network with cycle walking, see _feistel),
so any stretch of the epoch order or of a block's visiting order is computed in a few vectorised
operations per entry, without the rest: a rank pays for its share plus a vectorised per-shard
term (the shard order), never a Generator per shard. An elastic resume never builds the whole
pool: EpochRemainder counts what each old block left (O(1) per block) and replays only the old
blocks the rank's new range touches (see its note for the one case that costs more).
tests/partition_reference.py holds the reference path that builds the pool; tests compare.

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

import itertools
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import numpy.typing as npt

Policy = Literal["drop", "pad"]
POLICIES: tuple[str, ...] = get_args(Policy)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
U64Array = npt.NDArray[np.uint64]
UArray = npt.NDArray[np.unsignedinteger[Any]]

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


# -- Counter-based permutations ------------------------------------------------------------------
# A keyed Feistel network over [0, 4^half) with cycle walking is a bijection of [0, n) whose value
# at any position costs a few vectorised operations: no Generator per shard or block (28 us each),
# and any part of a permutation is computed without the rest of it.

_ROUNDS = 4
_CHUNK = 1 << 16  # positions per vectorised step: temporaries stay small, memory O(chunk)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
# Round-function multipliers per word (odd constants of the lowbias32 and splitmix64 finalisers).
_ROUND_MUL: dict[type, tuple[Any, Any]] = {
    np.uint32: (np.uint32(0x7FEB352D), np.uint32(0x846CA68B)),
    np.uint64: (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)),
}


def _mix64(z: U64Array) -> U64Array:
    """splitmix64's finaliser, elementwise: uint64 [...] -> uint64 [...]."""
    z = z ^ (z >> np.uint64(30))
    z *= _MIX[0]
    z ^= z >> np.uint64(27)
    z *= _MIX[1]
    z ^= z >> np.uint64(31)
    return z


def _word(max_value: int) -> type:
    """The narrowest unsigned word the cipher can use for values <= max_value (uint32 is SIMD)."""
    return np.uint32 if max_value < 2**32 else np.uint64


def _feistel(
    x: UArray, limit: Any, round_keys: UArray, key: UArray | None, bits: int
) -> UArray:
    """x (uint [m], each < limit) through a keyed bijection of [0, limit): uint [m].

    An unbalanced Feistel network permutes [0, 2^bits) (2^bits < 2 * limit): round r replaces
    (left, right) by (right, left ^ F(right)), F a multiply-xorshift hash of right, round_keys[r]
    (a scalar) and `key` (None, a scalar or uint [m]). A value that lands at or past `limit` goes
    through again (cycle walking) until it is inside. `limit`: a scalar or uint [m].
    """
    if bits == 0:  # limit 1: the only value is 0
        return x.copy()
    word = x.dtype.type
    mul1, mul2 = _ROUND_MUL[word]
    width = x.dtype.itemsize * 8
    mix_shift = word(width // 2 - 1)
    result = np.empty_like(x)  # uint [m]
    where: IntArray | None = None  # positions of `x` still walking; None: all of them
    current = x.copy()
    while True:
        high, low = bits // 2, bits - bits // 2  # widths of the left and right parts
        for r in range(_ROUNDS):
            left = current >> word(low)
            current &= word((1 << low) - 1)  # the right part, in place
            if high:
                f = current + round_keys[r]
                if key is not None:
                    f ^= key
                f *= mul1
                f ^= f >> mix_shift
                f *= mul2
                f >>= word(width - high)  # the top `high` bits depend on every input bit
                left ^= f
            current <<= word(high)
            current |= left
            high, low = low, high
        outside = current >= limit  # bool [m']
        if where is None:
            result[:] = current
        else:
            result[where] = current
        if not outside.any():
            return result
        keep = np.flatnonzero(outside)
        where = keep if where is None else where[keep]
        current = current[keep]
        if key is not None and np.ndim(key):
            key = key[keep]
        if np.ndim(limit):
            limit = limit[keep]


def _block_keys(key: tuple[int, ...]) -> U64Array:
    """Round keys of one block's visiting order: uint64 [ROUNDS]."""
    state = np.random.SeedSequence([*key, _TAG_BLOCK]).generate_state(_ROUNDS, np.uint64)
    return np.asarray(state, dtype=np.uint64)


def _permute_block(spots: IntArray, length: int, keys: U64Array) -> IntArray:
    """Where each block position (int64 [m], each < length) is visited: int64 [m]."""
    word = _word(length - 1)
    bits = (length - 1).bit_length()
    return _feistel(spots.astype(word), word(length), keys.astype(word), None, bits).astype(np.int64)


def _permute_within_shards(
    local: IntArray, sizes: IntArray, keys: U64Array, round_keys: U64Array
) -> IntArray:
    """Each local[j] (< sizes[j]) through its shard's bijection: int64 [m]. keys: uint64 [m].

    Elements are grouped by their shard's bit width so each group runs with scalar shifts.
    """
    smallest, largest = int(sizes.min()), int(sizes.max())
    word = _word(largest - 1)
    if smallest == largest:  # equal shards: scalar widths and limit
        bits = (largest - 1).bit_length()
        return _feistel(local.astype(word), word(largest), round_keys.astype(word),
                        keys.astype(word), bits).astype(np.int64)
    widths = np.frexp(np.maximum(sizes - 1, 0).astype(np.float64))[1]  # int [m], bit lengths
    out = np.empty_like(local)  # int64 [m]
    for bits in np.unique(widths).tolist():  # float rounding can only widen: still a bijection
        picked = np.flatnonzero(widths == bits)
        out[picked] = _feistel(local[picked].astype(word), sizes[picked].astype(word),
                               round_keys.astype(word), keys[picked].astype(word), bits)
    return out


class _EpochLayout:
    """Where each shard sits in the epoch order; holds per-shard arrays only ([S] each)."""

    def __init__(self, counts: IntArray, *, epoch: int, seed: int, shuffle: bool) -> None:
        self.counts = counts  # int64 [S]
        self.num_samples = int(counts.sum())
        self.shuffle = shuffle
        order = _shard_order(counts, epoch=epoch, seed=seed, shuffle=shuffle)  # int64 [S]
        self.slot_ends = np.cumsum(counts[order])  # int64 [S], epoch position past each slot
        self.order = order.astype(np.int32) if counts.size < 2**31 else order  # [S], shard per slot
        self.shard_starts = np.cumsum(counts) - counts  # int64 [S], global id of a shard's first
        base = np.random.SeedSequence([seed, epoch, _TAG_WITHIN_SHARD])
        self._base = np.asarray(base.generate_state(_ROUNDS + 1, np.uint64), dtype=np.uint64)

    def take(self, positions: IntArray) -> IntArray:
        """Global ids at ascending epoch positions (int64 [m]): int64 [m]."""
        out = np.empty(positions.size, np.int64)
        for lo in range(0, positions.size, _CHUNK):
            chunk = positions[lo : lo + _CHUNK]  # int64 [c]
            out[lo : lo + _CHUNK] = self._take_chunk(chunk)
        return out

    def _take_chunk(self, chunk: IntArray) -> IntArray:
        first, last = int(chunk[0]), int(chunk[-1])
        s0, s1 = np.searchsorted(self.slot_ends, [first, last], side="right").tolist()
        shards = self.order[s0 : s1 + 1].astype(np.int64)  # int64 [s], the slots it spans
        sizes = self.counts[shards]  # int64 [s]
        begins = self.slot_ends[s0 : s1 + 1] - sizes  # int64 [s], epoch position of each slot
        if last - first + 1 == chunk.size:  # contiguous: slots from run lengths, no search
            runs = np.minimum(begins + sizes, last + 1) - np.maximum(begins, first)  # int64 [s]
            rel = np.repeat(np.arange(s1 - s0 + 1), runs)  # int64 [c], slot - s0
        else:
            rel = np.searchsorted(self.slot_ends[s0 : s1 + 1], chunk, side="right")  # int64 [c]
        local = chunk - begins[rel]  # int64 [c], position inside the shard
        if self.shuffle:
            keys = _mix64(shards.astype(np.uint64) * _GOLDEN ^ self._base[-1])  # uint64 [s]
            local = _permute_within_shards(local, sizes[rel], keys[rel], self._base[:-1])
        return self.shard_starts[shards][rel] + local


def _shard_order(counts: IntArray, *, epoch: int, seed: int, shuffle: bool) -> IntArray:
    """Shard ids in the order the epoch lays them out: int64 [S]."""
    if not shuffle:
        return np.arange(counts.size, dtype=np.int64)
    return _rng(seed, epoch, _TAG_SHARD_ORDER).permutation(counts.size).astype(np.int64, copy=False)


def _block_bounds(num_items: int, world_size: int, rank: int) -> tuple[int, int]:
    """Pool positions [start, stop) of this rank's block; block sizes differ by at most one."""
    return rank * num_items // world_size, (rank + 1) * num_items // world_size


def _all_block_bounds(num_items: int, world_size: int) -> IntArray:
    """Every block's bounds at once: int64 [W + 1], block r = [bounds[r], bounds[r + 1])."""
    ranks = np.arange(world_size + 1, dtype=np.int64)  # int64 [W + 1]
    per, extra = divmod(num_items, world_size)  # r*N//W without forming r*N (no int64 overflow)
    return ranks * per + (ranks * extra) // world_size


def _arrange_block(
    values_at: Callable[[int, int], IntArray],
    length: int,
    *,
    num_entries: int,
    fallback: Callable[[], int],
    shuffle: bool,
    block_key: tuple[int, ...],
) -> Partition:
    """The rank's visiting order of its block, cut or padded to num_entries.

    `values_at(lo, hi)` gives the block's pool entries [lo, hi) (int64 [hi - lo]); the block has
    `length` of them, within one of num_entries. Shuffled, block entry q is visited at position
    P(q), P a keyed bijection of [0, length) that depends only on the length and key, so the fast
    path (one rank) and the resume path (any rank of a past segment) agree exactly; an entry
    visited at or past num_entries is dropped (`drop` removes the last visited entry of a long
    block). `pad` appends one flagged entry to a short block: the last real entry visited, or
    fallback() for an empty block.
    """
    kept = min(length, num_entries)
    indices = np.empty(num_entries, dtype=np.int64)  # int64 [n]
    keys = _block_keys(block_key)
    for lo in range(0, length if shuffle else kept, _CHUNK):
        hi = min(lo + _CHUNK, length if shuffle else kept)
        values = values_at(lo, hi)  # int64 [hi - lo]
        if not shuffle:
            indices[lo:hi] = values
            continue
        spots = _permute_block(np.arange(lo, hi, dtype=np.int64), length, keys)  # int64 [hi - lo]
        inside = spots < kept
        indices[spots[inside]] = values[inside]
    is_pad = np.zeros(num_entries, dtype=np.bool_)  # bool [n]
    if kept < num_entries:  # pad: a short block gets one flagged entry
        indices[-1] = indices[kept - 1] if kept else fallback()
        is_pad[-1] = True
    indices.setflags(write=False)  # shared by the sampler's views: nobody may edit them
    is_pad.setflags(write=False)
    return Partition(indices, is_pad)


def _block_key(seed: int, epoch: int, segment: int, world_size: int, rank: int) -> tuple[int, ...]:
    return (seed, epoch, segment, world_size, rank)


def _select(mask: BoolArray, ranks: IntArray) -> IntArray:
    """Positions of the ranks[j]-th True entries of mask (ranks ascending): int64 [m].

    O(mask) time; memory O(chunk + m), never a position array of the whole mask.
    """
    full = mask.size - mask.size % _CHUNK
    per_chunk = np.append(  # int64 [C], True entries per chunk (sums are buffered: no copy)
        mask[:full].reshape(-1, _CHUNK).sum(axis=1, dtype=np.int64),
        np.count_nonzero(mask[full:]),
    )
    ends = np.cumsum(per_chunk)  # int64 [C], True entries up to each chunk's end
    chunk_of = np.searchsorted(ends, ranks, side="right")  # int64 [m]
    out = np.empty(ranks.size, dtype=np.int64)
    cuts = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), ranks.size]
    for lo, hi in itertools.pairwise(cuts):  # loops over chunks, never entries
        if lo == hi:
            continue
        chunk = int(chunk_of[lo])
        found = np.flatnonzero(mask[chunk * _CHUNK : (chunk + 1) * _CHUNK])  # int64 [t]
        out[lo:hi] = chunk * _CHUNK + found[ranks[lo:hi] - (ends[chunk] - per_chunk[chunk])]
    return out


class _Stretch(NamedTuple):
    """One past segment as the lazy pool sees it: per-block figures only ([W] arrays)."""

    number: int  # segment number
    world_size: int
    consumed: int  # entries each rank consumed
    num_items: int  # size of the pool it split
    bounds: IntArray  # int64 [W + 1], block r = pool positions [bounds[r], bounds[r + 1])
    left: IntArray  # int64 [W], entries of each block still in the next pool
    left_ends: IntArray  # int64 [W], cumsum(left): next-pool position past each block's rest


class EpochRemainder:
    """What is left of one epoch after `segments`, computed only where a rank asks.

    pool_0 is the epoch order; pool_k+1 is pool_k minus the real entries consumed in segment k,
    in epoch order. Each pool is a concatenation, over the past segment's blocks, of what each
    block left, so its size needs only per-block counts (a block of length b whose rank consumed
    c entries left b - min(c, b)); a rank's entries of the last pool map back, block by block and
    segment by segment, to epoch positions, and only the old blocks they touch are replayed.

    Cost: O(this rank's entries + the old blocks its range touches + S + sum of past world
    sizes). With a ``visit_order`` under policy ``pad``, an old block one entry short holds a
    padding entry that may have been visited anywhere, so each such block of every segment is
    replayed in full to count what it left: O(N) in the worst case, as before.
    """

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
        self._visit_order = visit_order
        self._counts = counts  # int64 [S]
        self._built_layout: _EpochLayout | None = None  # made on the first lookup: counts need none
        self._stretches: list[_Stretch] = []
        self._last_mask: tuple[tuple[int, int], BoolArray] = ((-1, -1), np.empty(0, np.bool_))
        size = int(counts.sum())
        if segments:
            _check_enough_for_drop(size, int(segments[0][0]), policy)
        for index, segment in enumerate(segments):
            _check_segment(index, Segment(*segment), size, policy)
            stretch = self._stretch(index, Segment(*segment), size)
            self._stretches.append(stretch)
            size = int(stretch.left_ends[-1])
        self.num_samples = size  # samples left in the epoch

    @property
    def _layout(self) -> _EpochLayout:
        if self._built_layout is None:
            self._built_layout = _EpochLayout(
                self._counts, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle
            )
        return self._built_layout

    def entries_per_rank(self, world_size: int) -> int:
        """Entries every rank gets when what is left is split over world_size."""
        return entries_per_rank(self.num_samples, world_size, self.policy)

    def check_split(self, world_size: int, rank: int) -> None:
        """Raise PartitionError if what is left cannot be split over world_size for rank."""
        _check_world(world_size, rank)
        if not self._stretches:  # a fresh epoch under drop needs a sample per rank
            _check_enough_for_drop(self.num_samples, world_size, self.policy)

    def partition(self, world_size: int, rank: int) -> Partition:
        """This rank's entries of what is left, split over world_size as the next segment."""
        self.check_split(world_size, rank)
        size, level = self.num_samples, len(self._stretches)
        start, stop = _block_bounds(size, world_size, rank)
        return _arrange_block(
            lambda lo, hi: self._pool_at(level, np.arange(start + lo, start + hi, dtype=np.int64)),
            stop - start,
            num_entries=entries_per_rank(size, world_size, self.policy),
            fallback=lambda: self._one(level, min(start, size - 1)),
            shuffle=self.shuffle,
            block_key=_block_key(self.seed, self.epoch, level, world_size, rank),
        )

    def _one(self, level: int, position: int) -> int:
        return int(self._pool_at(level, np.array([position], dtype=np.int64))[0])

    def _stretch(self, index: int, segment: Segment, size: int) -> _Stretch:
        world_size, consumed = int(segment[0]), int(segment[1])
        bounds = _all_block_bounds(size, world_size)  # int64 [W + 1]
        lengths = np.diff(bounds)  # int64 [W]
        taken = np.minimum(lengths, consumed)  # int64 [W], real entries consumed per block
        if self._visit_order is not None and consumed:
            # A block holding a padding entry may have visited it anywhere: replay those.
            short = np.flatnonzero((lengths > 0) & (lengths < entries_per_rank(size, world_size,
                                                                               self.policy)))
            for block in short.tolist():
                visited = self._visited(self._visit_order, index, world_size, consumed, bounds, block)
                taken[block] = visited[1].size
        left = lengths - taken  # int64 [W]
        return _Stretch(index, world_size, consumed, size, bounds, left, np.cumsum(left))

    def _visited(
        self,
        visit_order: VisitOrder,
        index: int,
        world_size: int,
        consumed: int,
        bounds: IntArray,
        block: int,
    ) -> tuple[IntArray, IntArray]:
        """(the block's pool entries int64 [b], the real ids its rank consumed int64 [t])."""
        lo, hi = int(bounds[block]), int(bounds[block + 1])
        size = int(bounds[-1])
        values = self._pool_at(index, np.arange(lo, hi, dtype=np.int64))  # int64 [b]
        part = _arrange_block(
            lambda a, b: values[a:b],
            hi - lo,
            num_entries=entries_per_rank(size, world_size, self.policy),
            fallback=lambda: self._one(index, min(lo, size - 1)),
            shuffle=self.shuffle,
            block_key=_block_key(self.seed, self.epoch, index, world_size, block),
        )
        visited = visit_order(part, self.epoch, index, world_size, block)
        _check_visited(index, consumed, block, len(visited))
        return values, visited.indices[:consumed][~visited.is_pad[:consumed]]

    def _pool_at(self, level: int, positions: IntArray) -> IntArray:
        """Global ids at ascending positions of pool_level (int64 [m]): int64 [m]."""
        while level > 0:
            stretch = self._stretches[level - 1]
            level -= 1
            if stretch.consumed:
                positions = self._to_previous(stretch, positions)
        return self._layout.take(positions)

    def _to_previous(self, stretch: _Stretch, positions: IntArray) -> IntArray:
        """Positions in the pool the stretch split (int64 [m], ascending) of next-pool positions."""
        blocks = np.searchsorted(stretch.left_ends, positions, side="right")  # int64 [m]
        out = np.empty_like(positions)
        cuts = [0, *(np.flatnonzero(np.diff(blocks)) + 1).tolist(), positions.size]
        for lo, hi in itertools.pairwise(cuts):  # loops over old blocks, never entries
            if lo == hi:
                continue
            block = int(blocks[lo])
            ranks = positions[lo:hi] - (stretch.left_ends[block] - stretch.left[block])
            out[lo:hi] = stretch.bounds[block] + _select(self._left_mask(stretch, block), ranks)
        return out

    def _left_mask(self, stretch: _Stretch, block: int) -> BoolArray:
        """Which entries of an old block its rank left: bool [b], in pool order; the last one
        is kept, since a rank's positions arrive in chunks that mostly share an old block."""
        if self._last_mask[0] != (stretch.number, block):
            self._last_mask = ((stretch.number, block), self._replay(stretch, block))
        return self._last_mask[1]

    def _replay(self, stretch: _Stretch, block: int) -> BoolArray:
        lo, hi = int(stretch.bounds[block]), int(stretch.bounds[block + 1])
        if self._visit_order is not None:
            values, taken = self._visited(
                self._visit_order,
                stretch.number, stretch.world_size, stretch.consumed, stretch.bounds, block
            )
            return ~np.isin(values, taken)
        kept = min(stretch.consumed, hi - lo)  # the rank consumed visiting positions [0, kept)
        mask = np.ones(hi - lo, dtype=np.bool_)  # bool [b]
        if not self.shuffle:
            mask[:kept] = False
            return mask
        keys = _block_keys(_block_key(self.seed, self.epoch, stretch.number, stretch.world_size,
                                      block))
        for start in range(0, hi - lo, _CHUNK):
            spots = np.arange(start, min(start + _CHUNK, hi - lo), dtype=np.int64)
            mask[start : start + _CHUNK] = _permute_block(spots, hi - lo, keys) >= kept
        return mask


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
    _check_world(world_size, rank)
    remainder = EpochRemainder(
        shard_counts, segments=[], epoch=epoch, seed=seed, policy=policy, shuffle=shuffle
    )
    return remainder.partition(world_size, rank)


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


def _check_visited(index: int, consumed: int, rank: int, visited: int) -> None:
    """A rank's visit order must hold at least what the state says it consumed."""
    if visited < consumed:
        raise PartitionError(
            f"segments[{index}] has consumed_per_rank={consumed}, but rank {rank}'s visit "
            f"order has only {visited} entries: the state was saved with another loader "
            "(batch size, grouping); resume with the same one, or start the epoch fresh"
        )


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

    The remaining samples (what `segments` did not consume, in epoch order) are split like a
    fresh epoch: equal counts, each remaining sample once under `pad` (plus < W flagged padding),
    at most W-1 left out under `drop`. Nothing remaining gives every rank 0 entries; so does
    `drop` with fewer remaining samples than ranks (they are the at most W-1 left out). With no
    segments this is partition(). The split is segment number len(segments), so it never
    repeats an earlier one.
    The result is in partition order; `visit_order` only says how past segments were visited.
    Built by EpochRemainder: the remaining pool is never materialised (see its cost note).
    """
    _check_world(world_size, rank)
    remainder = EpochRemainder(
        shard_counts,
        segments=segments,
        epoch=epoch,
        seed=seed,
        policy=policy,
        shuffle=shuffle,
        visit_order=visit_order,
    )
    return remainder.partition(world_size, rank)

