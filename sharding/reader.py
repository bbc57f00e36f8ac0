"""Zero-copy, lazily opened, fork-safe reader of a sharded dataset.

``open_dataset(path)`` checks the manifest and every shard's magic, version and file sizes (a
stat and a few hundred header bytes per shard: cheap, catches truncation) but maps nothing. A
shard's files are memory-mapped the first time one of its samples is read *in the current
process*, so a rank (or DataLoader worker) maps only the shards its partition touches, and maps
inherited through ``fork`` are forgotten in the child. ``sample(i)`` returns numpy views into the
map: nothing is copied until a batch is collated. The dataset holds no per-sample Python objects:
offsets and leading sizes stay numpy arrays over the mapped index file, shared by every process
through the page cache, so refcount writes in workers copy nothing.
"""

from __future__ import annotations

import mmap
import operator
import os
import weakref
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sharding.format import (
    MANIFEST_NAME,
    OFFSET_DTYPE,
    DatasetChangedError,
    DatasetError,
    FieldSpec,
    FieldStats,
    IndexHeader,
    Manifest,
    ShardInfo,
    check_schemas_equal,
    corrupt,
    decode_index_head,
    fingerprint,
    format_schema,
    index_head_encoder,
    read_index_head,
    read_manifest,
)

if TYPE_CHECKING:
    import torch

# Python's mmap keeps a dup()ed descriptor per map, two per shard: cap the maps a process keeps
# so a dataset of thousands of shards cannot exhaust the usual 1024-descriptor limit.
DEFAULT_MAX_OPEN_SHARDS = 256


def open_dataset(
    path: str | os.PathLike[str], *, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS
) -> ShardedDataset:
    """Open the dataset at ``path``: check manifest, magic, version and sizes; map nothing yet."""
    root = Path(path).absolute()
    manifest = read_manifest(root)
    identity = manifest_identity(root)
    head_of = index_head_encoder(manifest.schema)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for number, info in enumerate(manifest.shards):
            if not shard_files_match(dir_fd, info, head_of(info)):
                _check_shard_files(root, number, info, manifest)  # raises, naming what differs
    finally:
        os.close(dir_fd)
    return ShardedDataset(root, manifest, max_open_shards=max_open_shards, identity=identity)


def manifest_identity(root: Path) -> tuple[int, ...]:
    """Which manifest file ``root`` holds now: device, inode, size, mtime and ctime. A publish
    (``jobs.prepare overwrite=true``) renames a whole new directory in, so every one of these
    changes; comparing them is one stat, where re-reading and hashing the manifest is not."""
    try:
        st = os.stat(os.path.join(root, MANIFEST_NAME))  # a str join: a Path costs more than the stat
    except OSError as e:
        raise DatasetChangedError(f"{root}: its {MANIFEST_NAME} is gone ({e.strerror}): the dataset was "
                                  f"removed or is being replaced while this process reads it") from e
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def shard_files_match(dir_fd: int, info: ShardInfo, head: bytes | None) -> bool:
    """Both files have the manifest's sizes and the index starts with exactly ``head``: what
    _check_shard_files checks, in a stat, an open and one small read, with no Path or decoded
    header per shard (20,000 shards opened in 1.3-2.8 s that way). False on any doubt: the
    caller then runs the full check, which names the problem."""
    if head is None:
        return False
    try:
        if os.stat(info.data_file, dir_fd=dir_fd).st_size != info.data_bytes:
            return False
        fd = os.open(info.index_file, os.O_RDONLY, dir_fd=dir_fd)
        try:
            return os.fstat(fd).st_size == info.index_bytes and os.pread(fd, len(head), 0) == head
        finally:
            os.close(fd)
    except OSError:
        return False


def check_shard_structure(root: Path, shard: int, manifest: Manifest) -> None:
    """Everything but checksums: sizes, header, schema, and that every sample lies in the file.

    Maps the shard's files for the duration of the call (verify uses it; readers map lazily).
    """
    _check_shard_files(root, shard, manifest.shards[shard], manifest)
    _map_shard(root, shard, manifest)


def _check_shard_files(root: Path, number: int, info: ShardInfo, manifest: Manifest) -> None:
    """Existence and exact size of both files, then the index header against the manifest."""
    for name, expected in ((info.data_file, info.data_bytes), (info.index_file, info.index_bytes)):
        _check_size(root / name, number, expected)
    header = read_index_head(root / info.index_file, number)
    _check_header(header, info, manifest, root / info.index_file, number)


def _check_size(path: Path, shard: int, expected: int) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError as e:
        raise corrupt(path, shard, "file is missing") from e
    if size != expected:
        what = "truncated" if size < expected else "longer than written"
        raise corrupt(path, shard, f"file is {size} bytes, the manifest says {expected} ({what})")


def _check_header(
    header: IndexHeader, info: ShardInfo, manifest: Manifest, path: Path, shard: int
) -> None:
    check_schemas_equal(manifest.schema, header.schema, path, shard)
    differ = [f"{key} {recorded} in the index header, {expected} in the manifest"
              for key, recorded, expected in (
                  ("num_samples", header.num_samples, info.num_samples),
                  ("data_bytes", header.data_bytes, info.data_bytes),
                  ("index_bytes", header.index_bytes, info.index_bytes))
              if recorded != expected]
    if differ:
        raise corrupt(path, shard, "; ".join(differ))


class _Field(NamedTuple):
    """One field of one mapped shard: what the hot path needs, unpacked once at map time.

    ``offsets``/``leading`` are memoryviews over the mapped index: indexing one yields a Python
    int (~50 ns), where a numpy scalar costs as much to index and doubles the cost of the
    np.ndarray() call that builds the view. ``offsets_array`` and ``leading_array`` are the
    same memory as numpy, for vectorized lookups (``ShardedDataset.spans``).
    """

    name: str
    dtype: np.dtype[Any]
    trailing: tuple[int, ...]
    offsets: memoryview  # int64 [num_samples]: byte offset of this field in the data file
    leading: memoryview | None  # int64 [num_samples]: leading sizes; None for a scalar field
    leading_array: np.ndarray | None
    offsets_array: np.ndarray


class _MappedShard(NamedTuple):
    data: mmap.mmap | bytearray
    fields: tuple[_Field, ...]
    bytes: np.ndarray  # uint8 view of data, for copying spans


# Maps opened by a parent must not be used by a forked child (a DataLoader worker): the at-fork
# hook drops them, so the child re-maps lazily. A hook costs nothing per read, where comparing
# os.getpid() on every read would add a syscall (~0.2 us, a few percent of a random read).
_LIVE_DATASETS: weakref.WeakSet[ShardedDataset] = weakref.WeakSet()


def _forget_maps_in_child() -> None:
    for dataset in list(_LIVE_DATASETS):
        dataset.close()


os.register_at_fork(after_in_child=_forget_maps_in_child)


class ShardedDataset:
    """A read-only sharded dataset; index it like a list. Create it with ``open_dataset``.

    ``ds.sample(i)`` -> ``{field: np.ndarray}`` views into the map (zero-copy);
    ``ds[i]`` -> the same as torch tensors (``torch.from_numpy``, still zero-copy);
    ``ds.read_into(i, field, out)`` copies one field straight into a caller's buffer.
    Global sample ``i`` is position ``i`` in the concatenation of shards in manifest order.
    """

    def __init__(
        self, root: Path, manifest: Manifest, *, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
        identity: tuple[int, ...] | None = None,
    ):
        if max_open_shards < 1:
            raise DatasetError(f"max_open_shards={max_open_shards} is invalid: must be >= 1")
        self.root = root
        self.manifest = manifest
        self.max_open_shards = max_open_shards
        counts = [s.num_samples for s in manifest.shards]
        self._ends = tuple(np.cumsum(counts, dtype=np.int64).tolist())  # one int per shard
        self._starts = (0, *self._ends[:-1])
        self._ends_array = np.asarray(self._ends, dtype=np.int64)
        self._length = self._ends[-1] if self._ends else 0
        self._field_numbers = {name: k for k, name in enumerate(manifest.schema)}
        self._fingerprint = fingerprint(manifest)
        # the manifest file this dataset was read from (manifest_identity); None: never checked
        self._identity = identity
        self._init_process_state()

    def _init_process_state(self) -> None:
        """State that belongs to one process: never pickled, dropped in a forked child."""
        self._mapped: list[_MappedShard | None] = [None] * len(self.manifest.shards)
        self._open_order: dict[int, None] = {}  # insertion-ordered: oldest map first
        self._leading_cache: dict[tuple[int, str], np.ndarray] = {}
        _LIVE_DATASETS.add(self)

    # -- pickling: cheap, and never carries a map or a descriptor ---------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_mapped", "_open_order", "_leading_cache"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # -- description -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (
            f"ShardedDataset({str(self.root)!r}, {self._length} samples in "
            f"{len(self._ends)} shards, fields {format_schema(self.schema)})"
        )

    @property
    def schema(self) -> Mapping[str, FieldSpec]:
        """Field name -> FieldSpec (dtype and shape, ``None`` marking the varying leading dim)."""
        return MappingProxyType(self.manifest.schema)

    @property
    def shard_counts(self) -> tuple[int, ...]:
        """Samples per shard in manifest order: what the partitioner consumes."""
        return tuple(s.num_samples for s in self.manifest.shards)

    @property
    def fingerprint(self) -> str:
        """16 hex digits from the schema, counts and checksums; ranks compare it at startup."""
        return self._fingerprint

    @property
    def attributes(self) -> Mapping[str, Any]:
        """What the writer recorded for readers (a text dataset's tokenizer, an image dataset's
        classes); empty for datasets written without. Files it names lie in ``self.root``."""
        return MappingProxyType(self.manifest.attributes)

    @property
    def field_stats(self) -> Mapping[str, FieldStats]:
        """Min and max leading size of each variable field (e.g. to preallocate padded batches)."""
        return MappingProxyType(self.manifest.field_stats)

    def value_range(self, field: str, recorded: bool = True) -> tuple[int, int]:
        """Smallest and largest value of an integer scalar field (labels): from the manifest when
        its writer recorded them (and ``recorded``), else read from every shard, vectorized (its
        8 bytes a sample); ``recorded=False`` is how verify checks the manifest's figures."""
        self._integer_scalar(field)
        noted = self.manifest.value_ranges.get(field) if recorded else None
        if noted is not None:
            return noted.min_value, noted.max_value
        ranges = [r for shard in range(len(self._ends))
                  if (r := self.shard_value_range(shard, field)) is not None]
        if not ranges:
            raise DatasetError(f"field {field!r} has no values: the dataset has no samples")
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def shard_value_range(self, shard: int, field: str) -> tuple[int, int] | None:
        """Smallest and largest value of an integer scalar field in one shard, read from its data
        file (never the manifest); None for an empty shard.

        One gather per block: every field starts at a multiple of 8, so the data file viewed as the
        field's dtype holds sample k's value at ``offset_k // itemsize``.
        """
        self._integer_scalar(field)
        num_samples = self.manifest.shards[shard].num_samples
        if num_samples == 0:
            return None
        mapped = self._mapped[shard] or self._map(shard)
        spot = mapped.fields[self._field_numbers[field]]
        size = spot.dtype.itemsize
        values = mapped.bytes[:len(mapped.bytes) // size * size].view(spot.dtype)
        lo, hi = [], []
        for start in range(0, num_samples, 1 << 20):  # bounded temporaries: 8 MB per block
            block = values[spot.offsets_array[start:start + (1 << 20)] // size]
            lo.append(int(block.min()))
            hi.append(int(block.max()))
        return min(lo), max(hi)

    def _integer_scalar(self, field: str) -> FieldSpec:
        spec = self.manifest.schema.get(field)
        if spec is None:
            raise self._unknown_field(field)
        if not spec.is_scalar or not np.issubdtype(spec.np_dtype, np.integer):
            raise DatasetError(f"field {field!r} is {spec}, not an integer scalar: it has no value range")
        return spec

    @property
    def fixed_fields(self) -> frozenset[str]:
        """Scalars and fields whose leading size is equal in every sample: collate stacks them."""
        stats = self.manifest.field_stats
        return frozenset(
            n
            for n, s in self.manifest.schema.items()
            if s.is_scalar or (n in stats and stats[n].min_leading == stats[n].max_leading)
        )

    @property
    def open_shards(self) -> tuple[int, ...]:
        """Shards mapped in this process, oldest first (lazy opening makes this a small set)."""
        return tuple(self._open_order)

    # -- reading: the hot path ---------------------------------------------------------------

    def sample(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i`` as ``{field: array}``: writable copy-on-write views into the map.

        Writing to a view never reaches the file, but this process's map keeps the change, so
        a later read of the same sample here sees it: copy before transforming in place.
        """
        # Global index -> (shard, local index) by one bisect over the per-shard ends, inline: bisect
        # on a tuple costs ~0.1 us where np.searchsorted costs ~1.2 us per scalar call, and a method
        # call ~0.1 us of a ~0.8 us read. ``locate`` is the vectorized form for many indices.
        i = operator.index(i)
        if not 0 <= i < self._length:
            i = self._wrap(i)
        shard = bisect_right(self._ends, i)
        local = i - self._starts[shard]
        mapped = self._mapped[shard] or self._map(shard)
        data = mapped.data
        out = {}
        for name, dtype, trailing, offsets, leading, _, _ in mapped.fields:
            shape = trailing if leading is None else (leading[local],) + trailing  # noqa: RUF005
            out[name] = np.ndarray(shape, dtype, data, offsets[local])
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i`` as ``{field: tensor}`` sharing memory with the map (torch.from_numpy)."""
        import torch  # deferred: `switchyard verify` and jobs.prepare need not pay for torch

        return {name: torch.from_numpy(a) for name, a in self.sample(i).items()}

    def read_into(self, i: int, field: str, out: np.ndarray) -> int:
        """Copy field ``field`` of sample ``i`` into ``out[:n]`` and return ``n``, its leading size.

        ``out`` has the field's dtype and trailing shape and at least ``n`` rows (e.g. row ``b``
        of a preallocated padded batch); for a scalar field ``out`` is 0-d (``batch[b, ...]``)
        and 1 is returned. Rows of ``out`` past ``n`` are left untouched.
        """
        i = operator.index(i)  # the lookup inlined, as in sample()
        if not 0 <= i < self._length:
            i = self._wrap(i)
        shard = bisect_right(self._ends, i)
        local = i - self._starts[shard]
        mapped = self._mapped[shard] or self._map(shard)
        try:
            _, dtype, trailing, offsets, leading, _, _ = mapped.fields[self._field_numbers[field]]
        except KeyError as e:
            raise self._unknown_field(field) from e
        num_rows = 1 if leading is None else leading[local]
        shape = trailing if leading is None else (num_rows,) + trailing  # noqa: RUF005
        if (
            (out.dtype is not dtype and out.dtype != dtype)
            or (out.shape[leading is not None :] != trailing)
            or (leading is not None and out.shape[0] < num_rows)
        ):
            raise _bad_buffer(field, i, dtype, trailing, None if leading is None else num_rows, out)
        src = np.ndarray(shape, dtype, mapped.data, offsets[local])
        if leading is None:
            out[...] = src
        else:
            out[:num_rows] = src
        return num_rows

    def _wrap(self, i: int) -> int:
        """A negative index counts from the end, as for a list; anything else out of range fails."""
        if -self._length <= i < 0:
            return i + self._length
        raise IndexError(f"sample index {i} is out of range for {self._length} samples")

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorized global index -> (shard numbers, local indices), both int64 arrays."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._length):
            bad = idx[(idx < 0) | (idx >= self._length)][0]
            raise IndexError(f"sample index {bad} is out of range for {self._length} samples")
        shards = np.searchsorted(self._ends_array, idx, side="right")
        return shards, idx - np.asarray(self._starts, dtype=np.int64)[shards]

    def spans(
        self, indices: np.ndarray, fields: Sequence[str]
    ) -> tuple[list[np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Where each sample's ``fields`` lie, for copying many samples without a view each.

        Returns ``(sources, {field: (starts, leading)})``: per sample the uint8 array over its
        shard's data file, and per field the byte offset in it and the leading size (1 for a
        scalar field). Field ``f`` of sample ``k`` is ``sources[k][s : s + leading[k] * row]``
        with ``s = starts[k]`` and ``row`` the byte size of one row of ``f`` (its trailing
        shape times its item size). The samples are located once for all fields; one
        vectorized lookup per shard and field, no per-sample Python beyond the list.
        """
        numbers = []
        for field in fields:
            if field not in self._field_numbers:
                raise self._unknown_field(field)
            numbers.append(self._field_numbers[field])
        shards, runs = self._shard_runs(indices)
        out = {field: (np.empty(len(shards), np.int64), np.ones(len(shards), np.int64)) for field in fields}
        by_shard: dict[int, np.ndarray] = {}
        for shard, run, local in runs:
            mapped = self._mapped[shard] or self._map(shard)
            by_shard[shard] = mapped.bytes
            for field, number in zip(fields, numbers, strict=True):
                spec, (starts, leading) = mapped.fields[number], out[field]
                starts[run] = spec.offsets_array[local]
                if spec.leading_array is not None:
                    leading[run] = spec.leading_array[local]
        return [by_shard[shard] for shard in shards.tolist()], out

    def _shard_runs(self, indices: np.ndarray) -> tuple[np.ndarray, list[tuple[int, np.ndarray, np.ndarray]]]:
        """(shard of each index, [(shard, positions of its indices, their local indices)]):
        the indices grouped by shard, for one vectorized lookup per shard."""
        shards, local = self.locate(indices)
        order = np.argsort(shards, kind="stable")
        runs = np.split(order, np.flatnonzero(np.diff(shards[order])) + 1)
        return shards, [(int(shards[run[0]]), run, local[run]) for run in runs if run.size]

    # -- leading sizes -----------------------------------------------------------------------

    def leading_sizes(self, field: str, indices: np.ndarray | None = None) -> np.ndarray:
        """Leading size of ``field`` for every sample (or for ``indices``), int64.

        Reads only the index files of the shards involved, never a data file.
        """
        self._variable_field(field)
        if indices is None:
            parts = [self._shard_leading(k, field) for k in range(len(self._ends))]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)
        shards, runs = self._shard_runs(indices)
        out = np.empty(len(shards), dtype=np.int64)
        for shard, run, local in runs:
            out[run] = self._shard_leading(shard, field)[local]
        return out

    def _variable_field(self, field: str) -> FieldSpec:
        spec = self.manifest.schema.get(field)
        if spec is None:
            raise self._unknown_field(field)
        if spec.is_scalar:
            raise DatasetError(f"field {field!r} is a scalar ({spec}): it has no leading size")
        return spec

    def _shard_leading(self, shard: int, field: str) -> np.ndarray:
        mapped = self._mapped[shard]
        if mapped is not None:
            leading = mapped.fields[self._field_numbers[field]].leading_array
            assert leading is not None  # _variable_field checked the schema
            return leading
        key = (shard, field)
        if key not in self._leading_cache:
            info = self.manifest.shards[shard]
            path = self.root / info.index_file
            header = read_index_head(path, shard)
            self._leading_cache[key] = np.fromfile(
                path, dtype=OFFSET_DTYPE, count=info.num_samples, offset=header.leading_at(field)
            )
        return self._leading_cache[key]

    def _unknown_field(self, field: str) -> DatasetError:
        return DatasetError(
            f"field {field!r} is not in the dataset at {self.root}: fields are "
            f"{', '.join(self.manifest.schema)}"
        )

    # -- mapping -----------------------------------------------------------------------------

    def check_unchanged(self) -> None:
        """Raise DatasetChangedError if the path no longer holds the dataset opened: its manifest
        is another file (a publish over it) or gone. One stat: readers call it at each epoch's
        start and before mapping a shard, never per sample, so a run cannot go on reading another
        dataset's shards under the samples' old numbers."""
        if self._identity is None or manifest_identity(self.root) == self._identity:
            return
        now = _manifest_fingerprint_now(self.root)
        raise DatasetChangedError(
            f"{self.root} was replaced while this run reads it: it was dataset {self._fingerprint} "
            f"when the run opened it and is {now} now (jobs.prepare overwrite=true, or a copy over "
            f"it), so the samples are no longer the ones the run started with. Restore the dataset "
            f"and resume, or train on the new one in a new run directory")

    def _map(self, shard: int) -> _MappedShard:
        """Map one shard in this process, check it, and remember it (evicting the oldest map)."""
        self.check_unchanged()  # a map reads the files at the path: they must still be this dataset's
        if len(self._open_order) >= self.max_open_shards:
            oldest = next(iter(self._open_order))
            del self._open_order[oldest]
            self._mapped[oldest] = None  # the map closes when its last view is gone
        mapped = _map_shard(self.root, shard, self.manifest)
        self._mapped[shard] = mapped
        self._open_order[shard] = None
        return mapped

    def close(self) -> None:
        """Forget every map of this process; views already handed out stay valid."""
        self._mapped = [None] * len(self.manifest.shards)
        self._open_order = {}
        self._leading_cache = {}

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _manifest_fingerprint_now(root: Path) -> str:
    """The fingerprint of the manifest at ``root`` now, for the message; what went wrong if none."""
    try:
        return f"dataset {fingerprint(read_manifest(root))}"
    except DatasetError as e:
        return f"unreadable ({e})"


def _map_shard(root: Path, shard: int, manifest: Manifest) -> _MappedShard:
    info = manifest.shards[shard]
    index_path, data_path = root / info.index_file, root / info.data_file
    index_map = _map_file(index_path, shard, info.index_bytes, mmap.ACCESS_READ)
    header = decode_index_head(index_map, index_path, shard)
    _check_header(header, info, manifest, index_path, shard)
    # ACCESS_COPY (copy-on-write) makes the views writable, so torch.from_numpy does not warn
    # about non-writable arrays, yet copies nothing: pages stay shared with the page cache until
    # someone writes, and such a write stays private to this process, never reaching the file.
    data = _map_file(data_path, shard, info.data_bytes, mmap.ACCESS_COPY)
    fields = []
    for number, (name, spec) in enumerate(manifest.schema.items()):
        offsets = np.frombuffer(
            index_map, OFFSET_DTYPE, info.num_samples, header.offsets_at(number)
        )
        leading = (
            None
            if spec.is_scalar
            else np.frombuffer(index_map, OFFSET_DTYPE, info.num_samples, header.leading_at(name))
        )
        _check_bounds(spec, offsets, leading, info.data_bytes, index_path, shard, name)
        fields.append(
            _Field(
                name,
                spec.np_dtype,
                spec.trailing,
                _int_view(offsets),
                None if leading is None else _int_view(leading),
                leading,
                offsets,
            )
        )
    return _MappedShard(data, tuple(fields), np.frombuffer(data, np.uint8))


def _int_view(array: np.ndarray) -> memoryview:
    """A memoryview yielding Python ints; zero-copy on little-endian hosts (a copy elsewhere)."""
    native = array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))
    return memoryview(native.data)


def _map_file(path: Path, shard: int, expected: int, access: int) -> Any:
    """Map a whole file after checking its size; an empty file maps to an empty buffer."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected:
                raise corrupt(path, shard, f"file is {size} bytes, the manifest says {expected}")
            return mmap.mmap(f.fileno(), 0, access=access) if size else bytearray()
    except FileNotFoundError as e:
        raise corrupt(path, shard, "file is missing") from e


def _check_bounds(
    spec: FieldSpec,
    offsets: np.ndarray,
    leading: np.ndarray | None,
    data_bytes: int,
    path: Path,
    shard: int,
    name: str,
) -> None:
    """Every (offset, size) must lie inside the data file: a bad index fails here, not mid-epoch."""
    if offsets.size == 0:
        return
    rows = np.ones_like(offsets) if leading is None else leading
    bad = (offsets < 0) | (offsets > data_bytes) | (offsets % 8 != 0) | (rows < 0)
    if spec.row_bytes:
        # Compared as a row count rather than offset + rows * row_bytes, which a corrupt
        # leading size could overflow past int64 into a negative, in-bounds-looking end.
        bad |= rows > (data_bytes - offsets) // spec.row_bytes
    if bad.any():
        local = int(np.flatnonzero(bad)[0])
        raise corrupt(
            path,
            shard,
            f"field {name!r} of local sample {local} lies outside the "
            f"{data_bytes}-byte data file (offset {offsets[local]}, "
            f"{rows[local]} rows of {spec.row_bytes} bytes)",
        )


def _bad_buffer(
    field: str,
    i: int,
    dtype: np.dtype[Any],
    trailing: tuple[int, ...],
    num_rows: int | None,
    out: np.ndarray,
) -> DatasetError:
    want = (
        "a 0-d array, e.g. batch[b, ...]"
        if num_rows is None
        else f"shape [>= {num_rows}{''.join(f', {d}' for d in trailing)}]"
    )
    return DatasetError(
        f"read_into(sample {i}, field {field!r}): out is {out.dtype.name}"
        f"{list(out.shape)}, it must be {dtype.name} with {want}"
    )
