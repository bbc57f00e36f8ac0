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

A batch sampler that visits the entries in another order (LengthGroupedBatchSampler) registers
that order with `set_visit_order`, so a resume on another world size rebuilds what each past
rank really consumed; the state records the order's name and a resume checks it.
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
    EpochRemainder,
    IntArray,
    Partition,
    PartitionError,
    Policy,
    Segment,
    VisitOrder,
    validate_shard_counts,
)

# 2: within-shard and block orders come from a keyed cipher, not a Generator per shard and block
# (the same guarantees, another order). Version 1 was never released: its states are refused.
STATE_VERSION = 2
PARTITION_ORDER = "partition"  # the visit-order name of a sampler iterated as it is
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
        self._num_entries = 0  # entries of the current segment, known before they are computed
        # What is left of the epoch; turned into `_current` on first use (iteration, partition,
        # segment), so set_epoch and load_state_dict cost a count, and one partition at most
        # lives at a time.
        self._remainder: EpochRemainder | None = None
        self._computed: Partition | None = None
        self._visit_order: VisitOrder | None = None  # None: entries visited in partition order
        self._visit_order_name = PARTITION_ORDER
        self._loaded_order: str | None = None  # the order named by the last loaded state
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
            self._loaded_order = None  # a fresh epoch owes nothing to the loaded state

    def _enter(self, epoch: int, segments: list[Segment], *, start: int) -> None:
        """Switch to this stretch of an epoch; checked first, so bad input changes nothing.

        Only counts are computed here; the entries follow on first use.
        """
        remainder = EpochRemainder(
            self._counts,
            segments=segments[:-1],
            epoch=epoch,
            seed=self.seed,
            policy=self.policy,
            shuffle=self.shuffle,
            visit_order=self._visit_order,
        )
        remainder.check_split(self.world_size, self.rank)
        num_entries = remainder.entries_per_rank(self.world_size)
        if start > num_entries:
            raise SamplerStateError(
                f"state_dict segments[-1] has consumed_per_rank={start}, but each rank has "
                f"{num_entries} entries there: the state was saved for other shard counts, "
                "seed or policy (resume with the same ones, or start the epoch with set_epoch)"
            )
        self._epoch, self._segments, self._start = epoch, segments, start
        self._remainder, self._computed, self._num_entries = remainder, None, num_entries

    @property
    def _current(self) -> Partition:
        """All entries of the current stretch of the epoch, computed on first use."""
        if self._computed is None:
            if self._remainder is None:
                raise RuntimeError("ShardedSampler has no epoch entered")  # __init__ enters one
            self._computed = self._remainder.partition(self.world_size, self.rank)
            self._remainder = None  # its per-shard arrays are not needed any more
        return self._computed

    @property
    def segment(self) -> tuple[Partition, int, int]:
        """(all entries of the current stretch of the epoch, its segment number, entries of it a
        resume skipped): what a batch sampler regrouping the stretch needs."""
        return self._current, len(self._segments) - 1, self._start

    def set_visit_order(self, visit_order: VisitOrder | None, name: str) -> None:
        """Entries are visited in ``visit_order`` (a pure function, see partition.VisitOrder),
        not in partition order; ``name`` identifies it (with its parameters) in the state."""
        if visit_order is None:
            name = PARTITION_ORDER
        self._check_order(self._loaded_order, name, self._segments)
        self._visit_order, self._visit_order_name = visit_order, name
        try:
            self._enter(self._epoch, list(self._segments), start=self._start)  # past stretches, replayed
        except PartitionError as error:
            raise SamplerStateError(f"the loaded state does not fit visit order {name}: {error}") from error

    @property
    def partition(self) -> Partition:
        """The entries `__iter__` yields (indices and is_pad), without the encoding."""
        return self._current.tail(self._start)

    def __len__(self) -> int:
        return self._num_entries - self._start

    def __iter__(self) -> Iterator[int]:
        part = self._current.tail(self._start)  # [len(self)]
        for lo in range(0, len(part), _YIELD_CHUNK):  # encoded a chunk at a time, never all
            chunk = Partition(part.indices[lo : lo + _YIELD_CHUNK], part.is_pad[lo : lo + _YIELD_CHUNK])
            yield from encode_array(chunk).tolist()

    def advance(self, num_entries: int) -> None:
        """Record that this rank consumed `num_entries` more entries (padding included)."""
        if isinstance(num_entries, bool) or not isinstance(num_entries, int | np.integer):
            raise TypeError(f"advance(num_entries={num_entries!r}): pass an int, e.g. len(batch)")
        world_size, consumed = self._segments[-1]
        total = self._num_entries
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
            "visit_order": self._visit_order_name,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch: exactly where it stopped if the last segment ran at this
        world size, else over what is left of it, split across this world."""
        epoch, segments = _parse_state(state)
        self._check_compatible(state)
        loaded_order = state.get("visit_order")  # absent in states saved before it was recorded
        self._check_order(loaded_order, self._visit_order_name, segments)
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
        self._loaded_order = loaded_order

    def _check_order(self, saved: str | None, mine: str, segments: Sequence[Segment]) -> None:
        """Progress recorded under one visit order means other entries under another."""
        if saved is None or saved == mine or not any(consumed for _, consumed in segments):
            return
        raise SamplerStateError(
            f"state_dict was saved visiting entries in order {saved!r}, but this sampler visits "
            f"them in order {mine!r}, so its progress would name other samples: build the loader "
            "as before (group_by_length, batch_size, drop_last) before load_state_dict, or call "
            "set_epoch to start the epoch fresh"
        )

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
    version = state["version"]
    if version == 1 and not isinstance(version, bool):
        raise SamplerStateError(
            f"state_dict version={version!r} is the sampler order of a development build before "
            f"Switchyard's first release; this code reads version {STATE_VERSION}, whose order "
            "differs, so the saved progress would name other samples: resume with the build that "
            "wrote it, or start the epoch fresh with set_epoch"
        )
    if version != STATE_VERSION or isinstance(version, bool):
        raise SamplerStateError(
            f"state_dict version={version!r}; this code reads version {STATE_VERSION} "
            "(a newer Switchyard wrote it: resume with that version)"
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
