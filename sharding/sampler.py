"""ShardedSampler: a torch Sampler over partition.py with flagged padding and exact resume.

Encoding of the yielded values (for whoever writes the Dataset adapter):

    value >= 0  a real entry: read global sample `value`.
    value <  0  a padding entry: read global sample `~value` (== -1 - value) so the batch has the
                right shape, then mask it out of losses and metrics.

`decode(value) -> (index, is_pad)` and `decode_array(values) -> (indices, is_pad)` undo it. A
global index is a position in the concatenation of the shards (see partition.py).

The trainer's side of the contract:

    sampler.set_epoch(epoch)              # before each epoch; the same epoch again is a no-op,
                                          # so it is safe to call right after load_state_dict
    for batch in loader:
        ...                               # optimizer step
        sampler.advance(len(batch))       # entries this rank consumed, padding included
    state = sampler.state_dict()          # the same on every rank (ranks step in lockstep)
    ...
    sampler.load_state_dict(state)        # same world: continues exactly; other world: splits
                                          # what is left of the epoch over the new ranks

The sampler cannot count consumption itself: the DataLoader prefetches, so what was yielded is
ahead of what was trained on. Hence `advance`.
"""

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

from sharding.partition import (
    POLICIES,
    BoolArray,
    IntArray,
    Partition,
    PartitionError,
    Policy,
    Segment,
    remaining_partition,
    validate_shard_counts,
)

STATE_VERSION = 1
_YIELD_CHUNK = 4096  # values converted to Python ints at a time, never the whole partition


class SamplerStateError(ValueError):
    """A state_dict that does not fit this sampler; the message says which field and why."""


def encode_array(partition: Partition) -> IntArray:
    """Values the sampler yields for these entries: int64 [n], ~index for padding."""
    return np.where(partition.is_pad, ~partition.indices, partition.indices)


def decode(value: int) -> tuple[int, bool]:
    """(global sample index, is_pad) of one value yielded by ShardedSampler."""
    return (~value, True) if value < 0 else (value, False)


def decode_array(values: npt.ArrayLike) -> tuple[IntArray, BoolArray]:
    """(global indices int64 [n], is_pad bool [n]) of yielded values (any int array [n])."""
    encoded = np.asarray(values, dtype=np.int64)  # int64 [n]
    is_pad = encoded < 0  # bool [n]
    return np.where(is_pad, ~encoded, encoded), is_pad


def shard_counts_digest(counts: IntArray) -> str:
    """Fingerprint of the shard counts, so a state is not applied to another dataset."""
    return hashlib.sha256(counts.astype("<i8").tobytes()).hexdigest()[:32]


class ShardedSampler(Sampler[int]):
    """This rank's entries of each epoch, in visiting order, encoded as described above.

    Every rank yields the same number of entries (`len(sampler)`). policy="pad" yields every
    sample once over all ranks plus fewer than world_size flagged padding entries; "drop" yields
    no padding and leaves out at most world_size-1 samples per epoch. shuffle=False visits the
    rank's block in natural order (for evaluation).
    """

    def __init__(
        self,
        shard_counts: Sequence[int] | npt.NDArray[np.integer],
        *,
        world_size: int,
        rank: int,
        seed: int = 0,
        policy: Policy = "pad",
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self._counts = validate_shard_counts(shard_counts)  # int64 [S]
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.policy: Policy = policy
        self.shuffle = shuffle
        self._epoch = 0
        self._segments: list[Segment] = []  # one per world size the epoch ran at; last: now
        self._start = 0  # entries of the current segment skipped by a resume
        self._current = Partition(np.empty(0, np.int64), np.empty(0, np.bool_))
        self._encoded: IntArray = np.empty(0, np.int64)  # int64 [n], what __iter__ yields
        # Computing epoch 0 now checks world, rank, seed and policy here, not mid-epoch.
        self._enter(0, [Segment(world_size, 0)], start=0)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_samples(self) -> int:
        return int(self._counts.sum())

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the current epoch again keeps the progress."""
        if epoch != self._epoch:
            self._enter(epoch, [Segment(self.world_size, 0)], start=0)

    def _enter(self, epoch: int, segments: list[Segment], *, start: int) -> None:
        """Switch to this stretch of an epoch; computed first, so bad input changes nothing."""
        current = remaining_partition(
            self._counts,
            segments=segments[:-1],
            world_size=self.world_size,
            rank=self.rank,
            epoch=epoch,
            seed=self.seed,
            policy=self.policy,
            shuffle=self.shuffle,
        )
        if start > len(current):
            raise SamplerStateError(
                f"state_dict segments[-1] has consumed_per_rank={start}, but each rank has "
                f"{len(current)} entries there: the state was saved for other shard counts, "
                "seed or policy (resume with the same ones, or start the epoch with set_epoch)"
            )
        self._epoch, self._segments, self._start = epoch, segments, start
        self._current, self._encoded = current, encode_array(current)

    @property
    def partition(self) -> Partition:
        """The entries `__iter__` yields (indices and is_pad), without the encoding."""
        return self._current.tail(self._start)

    def __len__(self) -> int:
        return len(self._current) - self._start

    def __iter__(self) -> Iterator[int]:
        encoded = self._encoded[self._start :]  # int64 [len(self)]
        for lo in range(0, encoded.size, _YIELD_CHUNK):
            yield from encoded[lo : lo + _YIELD_CHUNK].tolist()

    def advance(self, num_entries: int) -> None:
        """Record that this rank consumed `num_entries` more entries (padding included)."""
        if isinstance(num_entries, bool) or not isinstance(num_entries, int | np.integer):
            raise TypeError(f"advance(num_entries={num_entries!r}): pass an int, e.g. len(batch)")
        world_size, consumed = self._segments[-1]
        total = len(self._current)
        if num_entries < 0 or consumed + num_entries > total:
            raise ValueError(
                f"advance(num_entries={num_entries}) after {consumed} consumed would pass the "
                f"{total} entries rank {self.rank} has in epoch {self._epoch}: advance by the "
                "entries of each step only, and call set_epoch(next_epoch) before each epoch"
            )
        self._segments[-1] = Segment(world_size, consumed + int(num_entries))

    def state_dict(self) -> dict[str, Any]:
        """Progress through the current epoch; identical on every rank, so save it once."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "seed": self.seed,
            "policy": self.policy,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "shard_counts_digest": shard_counts_digest(self._counts),
            "segments": [[int(w), int(c)] for w, c in self._segments],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch: exactly where it stopped if the last segment ran at this
        world size, else over what is left of it, split across this world."""
        epoch, segments = _parse_state(state)
        self._check_compatible(state)
        while segments and segments[-1].consumed_per_rank == 0:
            segments.pop()  # a trailing stretch that consumed nothing changes nothing
        if segments and segments[-1].world_size == self.world_size:
            start = segments[-1].consumed_per_rank  # same world: continue that stretch exactly
        else:
            segments.append(Segment(self.world_size, 0))
            start = 0
        try:
            self._enter(epoch, segments, start=start)
        except PartitionError as error:
            raise SamplerStateError(f"state_dict does not fit this sampler: {error}") from error

    def _check_compatible(self, state: Mapping[str, Any]) -> None:
        expected = {
            "seed": self.seed,
            "policy": self.policy,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "shard_counts_digest": shard_counts_digest(self._counts),
        }
        for key, mine in expected.items():
            if state[key] != mine:
                raise SamplerStateError(
                    f"state_dict has {key}={state[key]!r} but this sampler has {key}={mine!r}: "
                    f"build the sampler with the same {key} (the same dataset for the counts), "
                    "or call set_epoch to start an epoch fresh instead of loading"
                )


def _parse_state(state: Mapping[str, Any]) -> tuple[int, list[Segment]]:
    """(epoch, segments) of a state_dict, checked for shape and types."""
    required = (
        "version",
        "epoch",
        "seed",
        "policy",
        "shuffle",
        "num_samples",
        "shard_counts_digest",
        "segments",
    )
    missing = [key for key in required if key not in state]
    if missing:
        raise SamplerStateError(
            f"state_dict lacks {missing}: pass what ShardedSampler.state_dict() returned"
        )
    if state["version"] != STATE_VERSION:
        raise SamplerStateError(
            f"state_dict version={state['version']!r}; this code reads version {STATE_VERSION}"
        )
    if state["policy"] not in POLICIES:
        raise SamplerStateError(f"state_dict policy={state['policy']!r}: not one of {POLICIES}")
    epoch = state["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise SamplerStateError(f"state_dict epoch={epoch!r}: must be an int >= 0")
    segments: list[Segment] = []
    for index, pair in enumerate(state["segments"]):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            pair_ok = False
        else:
            pair_ok = all(_is_plain_int(v) for v in pair)
        if not pair_ok:
            raise SamplerStateError(
                f"state_dict segments[{index}]={pair!r}: must be [world_size, consumed_per_rank]"
            )
        segments.append(Segment(int(pair[0]), int(pair[1])))
    return epoch, segments


def _is_plain_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
