"""The batched DataLoader path: one call per batch, samples copied straight into padded tensors.

``make_loader`` is the whole recipe::

    sampler = ShardedSampler(ds.shard_counts, world_size=W, rank=r, seed=0)
    loader = make_loader(ds, sampler, batch_size=64, num_workers=2)
    for batch in loader:            # batch["x"] [B, L, 64], batch["x_mask"] [B, L], ...
        ...
        sampler.advance(len(batch["index"]))

How a batch is built. The DataLoader draws one list of sampler values per batch (a batch
sampler over the ShardedSampler) and, because ``RankDataset`` defines ``__getitems__``, hands
the whole list to it in one call. ``__getitems__`` looks up the batch's leading sizes in one
vectorized call, allocates one ``[B, max_len, *trailing]`` tensor per variable field and copies
each sample from the memory map straight into its row: one copy per byte, no per-sample tensors,
no re-collation. The DataLoader still passes the finished batch to ``collate_fn``: ``pass_batch``
(an identity) is the one to use, and the one ``make_loader`` installs. With workers the batch is
built in the worker, directly in shared memory, so sending it to the main process copies nothing.
Without workers, batch memory comes from a few reused buffers (``BufferPool``): a buffer is
reused only once no tensor of its batch is alive, so keeping a batch is always safe.

A batch is a plain ``dict[str, torch.Tensor]``: the keys ``collate_padded`` gives, plus two
per-entry fields from the sampler. The per-sample path,
``collate_padded([rank_ds[v] for v in values], fixed=rank_ds.fixed)``, gives the same batch:

    field           [B, max_len, *trailing]  a variable field, padded with pad_value
    field_lengths   int64 [B]
    field_mask      bool [B, max_len]        True on real rows
    field           [B, *shape]              a fixed field (scalar, or constant leading size)
    index           int64 [B]                global sample id of each entry
    is_pad          bool [B]                 True for the sampler's padding entries (a real
                                             sample, read for its shape): mask them out of
                                             losses and metrics

``group_by_length=True`` regroups the rank's entries into batches of similar length: the same
entries with the same padding flags, and far less padding (``LengthGroupedBatchSampler``).
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, get_worker_info

from sharding.collate import length_grouped_batches
from sharding.format import DatasetError
from sharding.partition import Partition, Segment, remaining_partition
from sharding.reader import ShardedDataset, open_dataset
from sharding.sampler import ShardedSampler, decode, decode_array, encode_array, shard_counts_digest

Batch = dict[str, torch.Tensor]
ENTRY_FIELDS = ("index", "is_pad")  # keys every batch adds to the dataset's own fields


def pass_batch(batch: Batch) -> Batch:
    """The ``collate_fn`` for ``RankDataset``: the batch is already built, so return it as is.

    A module-level function, not a lambda, so workers started with ``spawn`` can unpickle it.
    """
    return batch


class _Field(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] | None  # per-sample shape of a stacked field; None: padded
    trailing: tuple[int, ...]


class RankDataset(Dataset[Batch]):
    """A ShardedDataset indexed by ShardedSampler values (negative = padding entry).

    ``rank_ds[value]`` -> one sample's tensors plus 0-d ``index`` and ``is_pad``;
    ``rank_ds.__getitems__(values)`` -> the padded batch described in the module docstring.
    ``fixed`` names the fields stacked rather than padded: by default the dataset's
    ``fixed_fields`` (scalars and fields whose leading size never varies). Pickling it to a
    worker carries no memory map: each process maps a shard when it first reads from it.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | ShardedDataset,
        *,
        fixed: Collection[str] | None = None,
        pad_value: float = 0,
    ) -> None:
        self.dataset = source if isinstance(source, ShardedDataset) else open_dataset(source)
        self.fixed = frozenset(self.dataset.fixed_fields if fixed is None else fixed)
        self.pad_value = pad_value
        _check_fields(self.dataset, self.fixed)
        self._fields = tuple(_field(self.dataset, name, self.fixed) for name in self.dataset.schema)
        self._pools = {f.name: BufferPool() for f in self._fields}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pools"]  # buffers belong to one process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pools = {f.name: BufferPool() for f in self._fields}

    @property
    def padded_fields(self) -> tuple[str, ...]:
        """Fields padded to the longest in the batch (with ``_lengths`` and ``_mask``)."""
        return tuple(f.name for f in self._fields if f.shape is None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, value: int) -> dict[str, torch.Tensor]:
        index, is_pad = decode(value)
        sample = self.dataset[index]
        sample["index"] = torch.tensor(index, dtype=torch.int64)
        sample["is_pad"] = torch.tensor(is_pad)
        return sample

    def __getitems__(self, values: Sequence[int]) -> Batch:
        if not len(values):
            raise DatasetError("RankDataset got an empty batch: there is nothing to read")
        indices, is_pad = decode_array(values)  # int64 [B], bool [B]
        shared = get_worker_info() is not None  # in a worker: build the batch in shared memory
        lengths = {name: self.dataset.leading_sizes(name, indices) for name in self.padded_fields}
        data = {f.name: self._allocate(f, len(indices), lengths, shared) for f in self._fields}
        self._copy_samples(indices.tolist(), data)
        # The small tensors, in numpy first: index, is_pad, then per padded field lengths, mask.
        small = [indices, is_pad]
        for name in self.padded_fields:
            max_len = data[name].shape[1]
            small += [lengths[name], np.arange(max_len)[None, :] < lengths[name][:, None]]  # [B, L]
        index, pad_flags, *per_field = _small_tensors(small, shared)
        batch: Batch = {}  # collate_padded's key order
        for f in self._fields:
            batch[f.name] = data[f.name]
            if f.shape is None:
                k = 2 * self.padded_fields.index(f.name)
                batch[f"{f.name}_lengths"], batch[f"{f.name}_mask"] = per_field[k], per_field[k + 1]
        batch["index"], batch["is_pad"] = index, pad_flags
        return batch

    def _allocate(
        self, field: _Field, num: int, lengths: dict[str, np.ndarray], shared: bool
    ) -> torch.Tensor:
        """Uninitialized ``[B, max_len, *trailing]`` (padded) or ``[B, *shape]`` (stacked)."""
        if field.shape is None:
            shape = (num, int(lengths[field.name].max()), *field.trailing)
        else:
            shape = (num, *field.shape)
        if shared:  # a worker's batch leaves the process: fresh shared memory
            return _shared_empty(shape, field.dtype)
        return self._pools[field.name].empty(shape, field.dtype)  # in-process: reused memory

    def _copy_samples(self, indices: list[int], data: dict[str, torch.Tensor]) -> None:
        """Copy every sample's fields from the map into row b of its field's batch tensor.

        One ``sample()`` per sample (views of all fields from one lookup), then one tight loop
        per field: measured faster than one ``read_into`` per field and sample, which locates
        the sample and checks the buffer each time (here the buffers fit by construction).
        """
        sample_of, pad_value = self.dataset.sample, self.pad_value
        samples = [sample_of(i) for i in indices]  # {field: view into the map} per sample
        for f in self._fields:
            out, name = data[f.name].numpy(), f.name
            if f.shape is not None:
                np.stack([sample[name] for sample in samples], out=out)  # [B, *shape]
                continue
            max_len = out.shape[1]
            for row, sample in zip(out, samples, strict=True):  # row: [max_len, *trailing]
                view = sample[name]
                num_rows = len(view)
                row[:num_rows] = view  # the one copy out of the memory map
                if num_rows < max_len:
                    row[num_rows:] = pad_value  # only the padding: batches are not zeroed


def _small_tensors(arrays: list[np.ndarray], shared: bool) -> list[torch.Tensor]:
    """The arrays as tensors: zero-copy in-process; in a worker, copied into one shared block
    (one shared-memory handle per batch for all of them, not one each)."""
    if not shared:
        return [torch.from_numpy(a) for a in arrays]
    tensors = _carve([(a.shape, torch.from_numpy(a).dtype) for a in arrays], shared=True)
    for tensor, array in zip(tensors, arrays, strict=True):
        tensor.numpy()[...] = array
    return tensors


def _field(dataset: ShardedDataset, name: str, fixed: frozenset[str]) -> _Field:
    spec = dataset.schema[name]
    dtype = torch.from_numpy(np.empty(0, spec.np_dtype)).dtype
    if spec.is_scalar:
        return _Field(name, dtype, (), ())
    if name in fixed:
        return _Field(name, dtype, (dataset.field_stats[name].min_leading, *spec.trailing), spec.trailing)
    return _Field(name, dtype, None, spec.trailing)


def _check_fields(dataset: ShardedDataset, fixed: frozenset[str]) -> None:
    """Fail at construction, not mid-epoch: unknown or varying ``fixed`` names, key clashes."""
    schema = dataset.schema
    for name in sorted(fixed):
        if name not in schema:
            raise DatasetError(f"fixed={sorted(fixed)} names {name!r}, which is not a field of "
                               f"{dataset.root}: fields are {', '.join(schema)}")
        if name not in dataset.fixed_fields:
            raise DatasetError(f"fixed={sorted(fixed)} names {name!r}, whose leading size varies "
                               f"between samples, so it cannot be stacked: leave it out of fixed")
    keys = [*ENTRY_FIELDS]
    for name in schema:
        keys += [name] if name in fixed else [name, f"{name}_lengths", f"{name}_mask"]
    clashes = sorted({k for k in keys if keys.count(k) > 1})
    if clashes:
        raise DatasetError(f"batch keys {clashes} would be produced twice (fields of {dataset.root} "
                           f"are {', '.join(schema)}; batches add <field>_lengths, <field>_mask, "
                           f"index and is_pad): rename the field when preparing the data")


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in shared memory, for a batch built in a worker.

    Allocated in shared memory from the start, as default_collate does in workers: a batch in
    ordinary memory would be copied into shared memory when the worker sends it.
    """
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return _carve([(shape, dtype)], shared=True)[0]


class BufferPool:
    """Hands out uninitialized tensors over a few reused buffers: batch memory that stays mapped.

    Why: a fresh multi-MB batch tensor often lands on pages the allocator just gave back to the
    kernel (glibc trims the top of its heap on free), so filling it page-faults on every 4 KiB
    page and the kernel zeroes each one first: measured here ~270 faults per 64-sample batch,
    half the batch time. A buffer is reused only once no tensor uses it any more: the tensor's
    storage holds the numpy view it was made from, and the pool watches that view through a
    weak reference. Views of the tensor keep it alive, so reuse is never premature. When all
    ``max_buffers`` are still in use (a caller keeping batches), it allocates as torch does.
    """

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []  # uint8 [capacity] each
        self._users: list[weakref.ref[np.ndarray] | None] = []  # the view last handed out
        self._lock = threading.Lock()  # a claim is a check and a set: one thread at a time

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        num_bytes = math.prod(shape) * np_dtype.itemsize
        with self._lock:
            slot = self._free_slot(num_bytes)
            if slot is None:
                return torch.empty(shape, dtype=dtype)
            view = self._buffers[slot][:num_bytes].view(np_dtype).reshape(shape)
            self._users[slot] = weakref.ref(view)
        return torch.from_numpy(view)

    def _free_slot(self, num_bytes: int) -> int | None:
        free = [k for k, user in enumerate(self._users) if user is None or user() is None]
        for k in free:
            if self._buffers[k].nbytes >= num_bytes:
                return k
        if len(self._buffers) < self.max_buffers:
            self._buffers.append(np.empty(0, np.uint8))
            self._users.append(None)
            free.append(len(self._buffers) - 1)
        if not free:
            return None
        self._buffers[free[0]] = np.empty(num_bytes, np.uint8)  # grow: batches vary in length
        return free[0]


def _carve(specs: Sequence[tuple[tuple[int, ...], torch.dtype]], shared: bool) -> list[torch.Tensor]:
    """Uninitialized tensors of these shapes and dtypes, views into one new block of memory.

    Sending a worker's batch costs a file descriptor and a map per shared block (measured:
    about 0.7 ms per block with 2 workers), so the small tensors of a batch share one.
    """
    itemsizes = [dtype.itemsize for _, dtype in specs]
    starts, num_bytes = [], 0
    for (shape, _), itemsize in zip(specs, itemsizes, strict=True):
        num_bytes = -(-num_bytes // itemsize) * itemsize  # aligned for the dtype
        starts.append(num_bytes // itemsize)  # in elements of the dtype
        num_bytes += math.prod(shape) * itemsize
    size = max(num_bytes, 1)
    storage = torch.UntypedStorage._new_shared(size) if shared else torch.UntypedStorage(size)
    return [
        torch.empty(0, dtype=dtype).set_(storage, start, shape, _contiguous_strides(shape))
        for (shape, dtype), start in zip(specs, starts, strict=True)
    ]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of this rank's sampler values with similar lengths of ``field``.

    The same entries as ``BatchSampler(sampler, batch_size, drop_last)``, padding flags kept,
    in ``length_grouped_batches`` order (seeded by the sampler's seed, epoch and rank); the
    same number of batches, so ranks still step in lockstep.

    Resume: ``sampler.advance(n)`` counts entries, and the grouping of an epoch is a pure
    function of the sampler's state, so a resume at the same world size continues exactly.
    After a resume at another world size the sampler rebuilds what was consumed assuming
    its own visiting order, which grouped batches did not follow: for the rest of that epoch
    some samples may repeat and others be skipped (a warning says so); exact again from the
    next epoch on.
    """

    def __init__(
        self,
        sampler: ShardedSampler,
        dataset: ShardedDataset,
        batch_size: int,
        *,
        field: str,
        drop_last: bool = False,
        batches_per_group: int = 64,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
        dataset.leading_sizes(field, np.zeros(0, np.int64))  # checks the field now
        _check_sampler_fits(dataset, sampler)
        self.sampler, self.dataset, self.field = sampler, dataset, field
        self.batch_size, self.drop_last, self.batches_per_group = batch_size, drop_last, batches_per_group

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        segment, segment_number, start = self._current_segment()
        values = encode_array(segment)  # int64 [n], ~index for padding
        lengths = self.dataset.leading_sizes(self.field, segment.indices)  # int64 [n]
        sampler = self.sampler
        seed = np.random.SeedSequence(
            [sampler.seed, sampler.epoch, segment_number, sampler.world_size, sampler.rank]
        ).generate_state(1)[0]
        batches = length_grouped_batches(values, lengths, self.batch_size, int(seed),
                                         batches_per_group=self.batches_per_group,
                                         drop_last=self.drop_last)
        position = 0  # entries of the segment before this batch, in grouped order
        for batch in batches:
            if position + len(batch) > start:
                yield batch[max(start - position, 0):].tolist()
            position += len(batch)

    def _current_segment(self) -> tuple[Partition, int, int]:
        """(all entries of the sampler's current stretch of the epoch, its number, entries
        of it already consumed), from the sampler's public state."""
        sampler = self.sampler
        segments = [Segment(int(w), int(c)) for w, c in sampler.state_dict()["segments"]]
        segment = remaining_partition(
            self.dataset.shard_counts, segments=segments[:-1], world_size=sampler.world_size,
            rank=sampler.rank, epoch=sampler.epoch, seed=sampler.seed, policy=sampler.policy,
            shuffle=sampler.shuffle,
        )
        start = len(segment) - len(sampler)
        tail = segment.tail(start)
        left = sampler.partition
        if not (np.array_equal(tail.indices, left.indices) and np.array_equal(tail.is_pad, left.is_pad)):
            raise DatasetError("LengthGroupedBatchSampler could not rebuild the sampler's epoch from "
                               "its state: ShardedSampler changed how it computes it; regroup "
                               "its partition instead (a bug to report, not a data problem)")
        if any(consumed for _, consumed in segments[:-1]):
            warnings.warn(
                f"group_by_length: epoch {sampler.epoch} resumed at world_size={sampler.world_size} "
                f"after running at {[w for w, _ in segments[:-1]]}; the sampler rebuilt what was "
                "consumed in its own visiting order, which grouped batches did not follow, so some "
                "samples may repeat or be skipped until the epoch ends",
                stacklevel=2,
            )
        return segment, len(segments) - 1, start


def _check_sampler_fits(dataset: ShardedDataset, sampler: ShardedSampler) -> None:
    counts = np.asarray(dataset.shard_counts, dtype=np.int64)
    if sampler.state_dict()["shard_counts_digest"] != shard_counts_digest(counts):
        raise DatasetError(
            f"the sampler was built for other shard counts ({sampler.num_samples} samples) than "
            f"the dataset at {dataset.root} has ({len(dataset)} samples in {len(counts)} shards): "
            "build it with ShardedSampler(dataset.shard_counts, ...)"
        )


def make_loader(
    source: str | os.PathLike[str] | ShardedDataset | RankDataset,
    sampler: ShardedSampler,
    batch_size: int,
    *,
    num_workers: int = 0,
    drop_last: bool = False,
    pin_memory: bool = False,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    group_by_length: bool = False,
    length_field: str | None = None,
    multiprocessing_context: str | None = None,
) -> DataLoader[Batch]:
    """A DataLoader of padded batches of this rank's entries: RankDataset + a batch sampler
    over ``sampler`` + ``pass_batch``. ``len(loader)`` is the same on every rank.

    ``persistent_workers`` defaults to ``num_workers > 0``: workers keep their memory maps
    between epochs (the sampler runs in the main process, so ``set_epoch`` still applies).
    ``group_by_length`` batches entries of similar ``length_field`` size (default: the first
    padded field); see LengthGroupedBatchSampler. Pass a RankDataset to choose ``fixed`` or
    ``pad_value``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
    dataset = source if isinstance(source, RankDataset) else RankDataset(source)
    _check_sampler_fits(dataset.dataset, sampler)
    batch_sampler: Sampler[list[int]]
    if group_by_length:
        if length_field is None and not dataset.padded_fields:
            raise DatasetError(f"group_by_length=True needs a variable-length field, but every field "
                               f"of {dataset.dataset.root} is stacked: set group_by_length=False")
        field = length_field if length_field is not None else dataset.padded_fields[0]
        batch_sampler = LengthGroupedBatchSampler(sampler, dataset.dataset, batch_size, field=field,
                                                  drop_last=drop_last)
    else:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        # DataLoader's stub types collate_fn as taking a list; with __getitems__ it gets the batch.
        collate_fn=cast(Callable[[list[Any]], Any], pass_batch),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0 if persistent_workers is None else persistent_workers,
        prefetch_factor=prefetch_factor,
        multiprocessing_context=multiprocessing_context,
    )
