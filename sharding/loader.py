"""The batched DataLoader path: one call per batch, samples copied straight into padded tensors.

``make_loader`` is the whole recipe::

    sampler = ShardedSampler(ds.shard_counts, world_size=W, rank=r, seed=0)
    loader = make_loader(ds, sampler, batch_size=64, num_workers=2)
    for batch in loader:            # batch["x"] [B, L, 64], batch["x_mask"] [B, L], ...
        ...
        sampler.advance(len(batch["index"]))

How a batch is built. The DataLoader draws one list of sampler values per batch (a batch
sampler over the ShardedSampler) and, because ``RankDataset`` defines ``__getitems__``, hands
the whole list to it in one call. ``__getitems__`` asks the reader where every sample's fields
lie (``ShardedDataset.spans``: located once, one vectorized lookup per shard), lays the batch out in one block
of bytes (``batch_memory.BatchLayout``: each variable field ``[B, max_len, *trailing]``, its
lengths and mask, the stacked fields, index, is_pad) and copies each sample's bytes from the
memory map straight to its row: one copy per byte, no per-sample views or tensors, no
re-collation; only padding rows are written besides. The DataLoader still passes the finished
batch to ``collate_fn``: ``pass_batch`` (an identity) is the one to use, and the one
``make_loader`` installs. Where the block comes from (a reused in-process buffer, a worker's
shared-memory ring slot, or fresh shared memory) is ``sharding.batch_memory``'s business;
keeping a batch is always safe.

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

import functools
import math
import multiprocessing.context
import os
import signal
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, get_worker_info

from sharding.batch_memory import (
    PAGE,
    SHM_DIR,
    BatchLayout,
    BatchRing,
    BufferPool,
    SharedMemoryError,
    as_tensors,
    batch_layout,
    numpy_views,
    shared_block,
    shm_free_bytes,
    tensor_views,
)
from sharding.collate import length_grouped_batches
from sharding.format import DatasetError
from sharding.partition import Partition
from sharding.reader import ShardedDataset, open_dataset
from sharding.sampler import ShardedSampler, decode, decode_array, encode_array, shard_counts_digest

Batch = dict[str, torch.Tensor]
ENTRY_FIELDS = ("index", "is_pad")  # keys every batch adds to the dataset's own fields


def pass_batch(batch: Batch) -> Batch:
    """The ``collate_fn`` for ``RankDataset``: the batch is already built, so return it as is.

    A module-level function, not a lambda, so workers started with ``spawn`` can unpickle it.
    """
    return batch


class _Reads(NamedTuple):
    """What one batch reads: its entries and where their fields lie (``ShardedDataset.spans``)."""

    indices: np.ndarray  # int64 [B] global sample ids
    is_pad: np.ndarray  # bool [B]
    sources: list[np.ndarray]  # per entry, the uint8 data of its shard
    spans: dict[str, tuple[np.ndarray, np.ndarray]]  # field -> (byte starts, leading sizes)


class _Field(NamedTuple):
    name: str
    np_dtype: np.dtype[Any]
    shape: tuple[int, ...] | None  # per-sample shape of a stacked field; None: padded
    trailing: tuple[int, ...]
    row_bytes: int  # bytes of one row (a scalar field: the item)


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
        self._names = tuple(f.name for f in self._fields)
        self._zero_pad = {f.name: _pad_is_zero(f, pad_value) for f in self._fields if f.shape is None}
        self._pool = BufferPool()  # in-process batch memory
        self._rings: list[BatchRing] | None = None  # one per worker, set while workers start

    def __getstate__(self) -> dict[str, Any]:
        """No buffers (they belong to one process); the rings only to a worker being started."""
        state = self.__dict__.copy()
        del state["_pool"]
        if multiprocessing.context.get_spawning_popen() is None:  # not a worker being spawned
            state["_rings"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = BufferPool()

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
        reads = _Reads(indices, is_pad, *self.dataset.spans(indices, self._names))
        layout = self._layout(len(indices), {f.name: int(reads.spans[f.name][1].max())
                                             for f in self._fields if f.shape is None})
        worker = get_worker_info()
        if worker is None:  # in-process: reused buffers
            return as_tensors(self._fill(self._pool.block(layout.nbytes), layout, reads))
        ring = self._rings[worker.id] if self._rings else None
        slot = ring.claim(layout.nbytes) if ring is not None else None
        if ring is not None and slot is not None:  # this worker's ring: nothing new to map or send
            return ring.batch(slot, layout, self._fill(ring.slot(slot, layout.nbytes), layout, reads))
        shared = shared_block(layout.nbytes)  # every slot still in use: fresh shared memory
        self._fill(shared.numpy(), layout, reads)
        return tensor_views(shared, layout)  # views of the shared storage: torch sends its handle

    def batch_bytes(self, batch_size: int) -> int:
        """Bytes of the largest batch of ``batch_size`` entries: every field at its longest."""
        stats = self.dataset.field_stats
        return self._layout(batch_size, {name: stats[name].max_leading for name in self.padded_fields}).nbytes

    def _layout(self, num: int, max_lengths: dict[str, int]) -> BatchLayout:
        """Keys in collate_padded's order: per field its data (then _lengths and _mask when
        padded), then index and is_pad."""
        specs: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
        for f in self._fields:
            if f.shape is not None:
                specs.append((f.name, f.np_dtype, (num, *f.shape)))
                continue
            max_len = max_lengths[f.name]
            specs += [(f.name, f.np_dtype, (num, max_len, *f.trailing)),
                      (f"{f.name}_lengths", _INT64, (num,)), (f"{f.name}_mask", _BOOL, (num, max_len))]
        return batch_layout([*specs, ("index", _INT64, (num,)), ("is_pad", _BOOL, (num,))])

    def _fill(self, block: np.ndarray, layout: BatchLayout, reads: _Reads) -> dict[str, np.ndarray]:
        """Copy every sample's fields from the map into its row of the batch, ``block`` (uint8);
        -> the batch's arrays over ``block``.

        One byte copy per sample and field, from the span the reader located for it
        (``ShardedDataset.spans``, vectorized per batch), straight to its offset in the block:
        no view or dict per sample. Only padding is written besides: a memset when the pad
        value is zero bytes. Blocks are reused, never zeroed as a whole.
        """
        arrays = numpy_views(block, layout)
        offsets = {part.key: part.offset for part in layout.parts}
        for f in self._fields:
            starts, leading = reads.spans[f.name]
            data = arrays[f.name]
            stride = data[0].nbytes  # bytes per sample in the batch: max_len rows, or the shape
            zero_pad = self._zero_pad.get(f.name, True)  # stacked fields have no padding
            at = offsets[f.name]
            sizes = (leading * f.row_bytes).tolist()  # bytes of each sample's field
            for source, start, num_bytes in zip(reads.sources, starts.tolist(), sizes, strict=True):
                block[at : at + num_bytes] = source[start : start + num_bytes]  # the one copy
                if num_bytes < stride and zero_pad:
                    block[at + num_bytes : at + stride] = 0
                at += stride
            if f.shape is not None:
                continue
            max_len = data.shape[1]
            if not zero_pad:
                for row, num_rows in zip(data, leading.tolist(), strict=True):
                    row[num_rows:] = self.pad_value
            arrays[f"{f.name}_lengths"][...] = leading
            np.less(np.arange(max_len), leading[:, None], out=arrays[f"{f.name}_mask"])
        arrays["index"][...] = reads.indices
        arrays["is_pad"][...] = reads.is_pad
        return arrays


def _pad_is_zero(field: _Field, pad_value: float) -> bool:
    """Whether ``pad_value`` is all zero bytes in the field's dtype (padding is then a memset);
    fails here, not mid-epoch, when the field cannot hold it."""
    try:
        pad = np.array(pad_value, field.np_dtype)
    except (OverflowError, ValueError) as e:
        raise DatasetError(f"pad_value={pad_value!r} does not fit field {field.name!r} "
                           f"({field.np_dtype}): choose a pad value that dtype can hold") from e
    return not pad.tobytes().strip(b"\0")


_INT64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)


def _field(dataset: ShardedDataset, name: str, fixed: frozenset[str]) -> _Field:
    spec = dataset.schema[name]
    dtype = np.dtype(spec.np_dtype)
    row_bytes = math.prod(spec.trailing) * dtype.itemsize
    if spec.is_scalar:
        return _Field(name, dtype, (), (), row_bytes)
    if name in fixed:
        shape = (dataset.field_stats[name].min_leading, *spec.trailing)
        return _Field(name, dtype, shape, spec.trailing, row_bytes)
    return _Field(name, dtype, None, spec.trailing, row_bytes)


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


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of this rank's sampler values with similar lengths of ``field``.

    The same entries as ``BatchSampler(sampler, batch_size, drop_last)``, padding flags kept,
    in ``length_grouped_batches`` order (seeded by the sampler's seed, epoch, segment, world
    size and rank); the same number of batches, the short one last, so ranks still step in
    lockstep and consume equal numbers of entries.

    Resume: ``sampler.advance(n)`` counts entries, and the grouping of a stretch of an epoch is
    a pure function of the sampler's state, so a resume at the same world size continues
    exactly. The grouping is registered with the sampler as its visit order
    (``ShardedSampler.set_visit_order``), so a resume at another world size rebuilds what each
    past rank consumed in grouped order: every remaining sample of the epoch still comes once.
    The sampler's state names the grouping; resuming it with another one is refused.
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
        sampler.set_visit_order(self.visit_order, self.order_name)

    @property
    def order_name(self) -> str:
        """What the sampler's state records: everything the grouped order depends on."""
        return (f"length-grouped(field={self.field}, batch_size={self.batch_size}, "
                f"batches_per_group={self.batches_per_group}, drop_last={self.drop_last})")

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        segment, number, start = self.sampler.segment
        sampler = self.sampler
        position = 0  # entries of the segment before this batch, in grouped order
        for batch in self._grouped(segment, sampler.epoch, number, sampler.world_size, sampler.rank):
            if position + len(batch) > start:
                yield batch[max(start - position, 0):].tolist()
            position += len(batch)

    def visit_order(self, part: Partition, epoch: int, segment: int, world_size: int,
                    rank: int) -> Partition:
        """``part``'s entries in the order this batch sampler yields them (partition.VisitOrder)."""
        batches = self._grouped(part, epoch, segment, world_size, rank)
        indices, is_pad = decode_array(np.concatenate(batches) if batches else np.zeros(0, np.int64))
        return Partition(indices, is_pad)

    def _grouped(self, part: Partition, epoch: int, segment: int, world_size: int,
                 rank: int) -> list[np.ndarray]:
        """``part`` as batches of encoded sampler values, grouped by length."""
        lengths = self.dataset.leading_sizes(self.field, part.indices)  # int64 [n]
        key = [self.sampler.seed, epoch, segment, world_size, rank]
        seed = np.random.SeedSequence(key).generate_state(1)[0]
        return length_grouped_batches(encode_array(part), lengths, self.batch_size, int(seed),
                                      batches_per_group=self.batches_per_group, drop_last=self.drop_last)


def _check_sampler_fits(dataset: ShardedDataset, sampler: ShardedSampler) -> None:
    counts = np.asarray(dataset.shard_counts, dtype=np.int64)
    if sampler.state_dict()["shard_counts_digest"] != shard_counts_digest(counts):
        raise DatasetError(
            f"the sampler was built for other shard counts ({sampler.num_samples} samples) than "
            f"the dataset at {dataset.root} has ({len(dataset)} samples in {len(counts)} shards): "
            "build it with ShardedSampler(dataset.shard_counts, ...)"
        )


class ShardedLoader(DataLoader[Batch]):
    """The DataLoader ``make_loader`` returns: a plain DataLoader that gives each worker a
    ``BatchRing`` of ``ring_slots`` reusable batch slots in shared memory.

    The rings are made each time workers start (the first epoch with persistent workers, every
    epoch without), handed to the workers through the dataset while they start, and kept by the
    iterator: the main process needs them to turn a worker's (ring, slot, layout) back into
    tensors. A slot holds the largest batch possible (every padded field at its longest), so
    any batch fits; torch reserves all slots in /dev/shm up front, so their total is checked
    against its free space before any is made.

    Each new iterator (each epoch) draws its workers' base seed from ``generator``: by default a
    generator of the loader's own, never torch's global one. A DataLoader draws from the global
    generator otherwise, so the dropout masks after a resume (a new iterator at the restored
    position) differed from an uninterrupted run's, and a resume with dropout was not exact.
    """

    def __init__(self, dataset: RankDataset, *args: Any, ring_slots: int | None = None,
                 worker_ignores: tuple[signal.Signals, ...] = (), **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator().manual_seed(0))
        if worker_ignores:
            kwargs["worker_init_fn"] = functools.partial(
                _ignore_signals, worker_ignores, kwargs.get("worker_init_fn"))
        super().__init__(dataset, *args, **kwargs)
        self.ring_slots = ring_slots
        self.worker_ignores = worker_ignores

    def __iter__(self) -> Any:
        # each epoch's start: the dataset at the path must still be the one opened (one stat);
        # persistent workers reuse their maps, and new ones would map whatever the path holds
        # (a task's own source, with shard_counts and __getitems__, may wrap no ShardedDataset)
        opened = getattr(self.dataset, "dataset", None)
        if isinstance(opened, ShardedDataset):
            opened.check_unchanged()
        return super().__iter__()

    def _get_iterator(self) -> Any:
        if self.num_workers == 0 or not self.worker_ignores:
            return self._start_workers()
        # Blocked while the workers start, so a signal sent to the whole job in that instant
        # waits in a worker until its init function ignores it (and in this process until the
        # iterator exists, then it is handled here as usual): never torch's worker handler.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, self.worker_ignores)
        try:
            return self._start_workers()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _start_workers(self) -> Any:
        dataset = cast(RankDataset, self.dataset)
        if self.num_workers == 0:
            return super()._get_iterator()
        slots = (self.prefetch_factor or 2) + 2 if self.ring_slots is None else self.ring_slots
        batch_size = getattr(self.batch_sampler, "batch_size", None)
        if not slots or batch_size is None:
            return super()._get_iterator()
        check_shared_memory(ring_bytes(dataset, batch_size, self.num_workers, slots), batch_size,
                            self.num_workers)
        rings = [BatchRing(dataset.batch_bytes(batch_size), slots) for _ in range(self.num_workers)]
        dataset._rings = rings  # workers get theirs by worker id: inherited (fork) or pickled (spawn)
        try:
            iterator = super()._get_iterator()
        finally:
            dataset._rings = None  # the main process's dataset does not need them
        # Kept alive as long as batches can arrive from these workers.
        iterator._switchyard_rings = rings  # type: ignore[attr-defined]
        return iterator


def _ignore_signals(signals: tuple[signal.Signals, ...], then: Callable[[int], None] | None,
                    worker_id: int) -> None:
    """A worker's init: ``signals`` are the main process's to act on. torch's worker handler dies
    of SIGTERM, and the main process then raises "DataLoader worker (pid N) is killed by signal"
    before it reaches the step boundary where it would checkpoint."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    if then is not None:
        then(worker_id)


def ring_bytes(dataset: RankDataset, batch_size: int, num_workers: int, slots: int | None = None,
               prefetch_factor: int = 2) -> int:
    """Shared memory the batch rings of one loader take: ``num_workers`` rings of ``slots`` slots
    (default ``prefetch_factor + 2``), each slot the largest batch, page-rounded. torch reserves
    all of it when the rings are made, so it must fit in /dev/shm at once."""
    slots = prefetch_factor + 2 if slots is None else slots
    if num_workers == 0 or slots == 0:
        return 0
    slot = max(-(-dataset.batch_bytes(batch_size) // PAGE) * PAGE, PAGE)
    return num_workers * slots * slot


def check_shared_memory(needed: int, batch_size: int, num_workers: int, ranks: int = 1) -> None:
    """Refuse, before allocating anything, rings that ``ranks`` loaders of ``needed`` bytes each
    (the ranks of one node) cannot fit in /dev/shm; the error names the keys to change."""
    free = shm_free_bytes()
    if free is None or needed * ranks <= free:
        return
    raise SharedMemoryError(
        f"data.batch_size={batch_size} with data.num_workers={num_workers} needs "
        f"{needed * ranks / 1e6:,.0f} MB of shared "
        f"memory for worker batches ({ranks} rank(s) x {needed / 1e6:,.0f} MB: each worker keeps "
        f"a few slots of the largest possible batch) but {SHM_DIR} has {free / 1e6:,.0f} MB free: "
        f"lower data.batch_size or data.num_workers, set data.num_workers=0, or give the job a "
        f"larger {SHM_DIR} (containers: --shm-size)")


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
    ring_slots: int | None = None,
    worker_ignores: tuple[signal.Signals, ...] = (),
) -> ShardedLoader:
    """A DataLoader of padded batches of this rank's entries: RankDataset + a batch sampler
    over ``sampler`` + ``pass_batch``. ``len(loader)`` is the same on every rank.

    ``persistent_workers`` defaults to ``num_workers > 0``: workers keep their memory maps
    between epochs (the sampler runs in the main process, so ``set_epoch`` still applies).
    ``group_by_length`` batches entries of similar ``length_field`` size (default: the first
    padded field); see LengthGroupedBatchSampler. Pass a RankDataset to choose ``fixed`` or
    ``pad_value``. ``ring_slots``: batch slots per worker in shared memory reused across
    batches (default ``prefetch_factor + 2``; 0 builds every worker batch in fresh shared
    memory, as torch does); see ShardedLoader. ``worker_ignores``: signals the workers ignore,
    leaving them to the main process (a trainer's stop signals: SIGTERM, SIGUSR2).
    """
    if ring_slots is not None and ring_slots < 0:
        raise ValueError(f"ring_slots={ring_slots} is invalid: must be >= 0 (0 turns the rings off)")
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
    return ShardedLoader(
        dataset,
        ring_slots=ring_slots,
        worker_ignores=worker_ignores,
        batch_sampler=batch_sampler,
        # DataLoader's stub types collate_fn as taking a list; with __getitems__ it gets the batch.
        collate_fn=cast(Callable[[list[Any]], Any], pass_batch),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0 if persistent_workers is None else persistent_workers,
        prefetch_factor=prefetch_factor,
        multiprocessing_context=multiprocessing_context,
    )
