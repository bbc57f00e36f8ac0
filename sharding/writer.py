"""Streaming writer: append samples, roll shards at ``shard_bytes``, publish atomically.

Everything is written into a sibling temp directory ``.<name>.tmp-<random>``; the manifest is
written last, every file is fsynced, and only then is the directory renamed into place. A crash, a
bad sample or an exception inside the ``with`` block therefore never leaves a directory at
``path`` that looks like a finished dataset. Samples are validated completely before any byte of
them is written, so a refused sample leaves the writer usable.

A writer holds an flock on the file ``.lock`` in its temp directory while it writes (a regular
file opened read-write, not the directory: NFS emulates flock with byte-range locks, which need a
file open for writing). A writer killed outright (SIGKILL, the OOM killer, a node gone) cannot
remove its directory, but the kernel drops its lock; so each new writer removes the temp siblings
of its path whose lock it can take, and never a live writer's. A directory without a ``.lock``
(a writer in its first instant, or on a file system without flock) is left alone: nobody can tell
whether its writer lives.

A full disk (or quota, or a read-only file system), from the first directory to the last rename,
is a WriteError naming the output, the bytes written and the space left; the temp directory is
removed and nothing is published.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np
import xxhash

from durable.atomic import fsync_dir
from sharding.format import (
    MANIFEST_NAME,
    DatasetError,
    FieldSpec,
    FieldStats,
    FileInfo,
    Manifest,
    Schema,
    SchemaMismatchError,
    ShardInfo,
    ValueRange,
    WriteError,
    describe_array,
    dtype_name,
    encode_index_head,
    extra_file_name_problem,
    foreign_files,
    new_hasher,
    pad8,
    shard_file_names,
)
from sharding.lease import live_readers

DEFAULT_SHARD_BYTES = 256 * 2**20
_ZEROS = bytes(8)
LOCK_NAME = ".lock"  # in a writer's temp directory while it writes; gone before the publish
# Temp directories of this process's open writers. A remover never opens their lock: where flock
# is emulated by POSIX byte-range locks (NFS), a process's own locks never conflict with it, and
# closing any descriptor of the file would drop the lock of the writer that holds it.
_OWN_TEMP_DIRS: set[Path] = set()


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse an existing ``path`` unless ``overwrite`` and it is a dataset or an empty directory.

    Called before any work starts, and again just before publishing. Overwrite replaces only what
    a dataset owns: a directory that is not a dataset (``output=$HOME overwrite=true`` must not
    erase a home), or a dataset directory holding any other file (the user's notes, the very input
    being converted), is refused, naming what would be lost.
    """
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise DatasetError(f"{path} already exists: choose another output, or replace it "
                           f"with overwrite=true")
    if not path.is_dir() or not ((path / MANIFEST_NAME).is_file() or not any(path.iterdir())):
        raise DatasetError(f"{path} exists and is not a dataset (no {MANIFEST_NAME}): "
                           f"overwrite=true only replaces datasets; remove it yourself")
    if foreign := foreign_files(path):
        shown = ", ".join(repr(name) for name in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise DatasetError(f"{path} holds files that are not part of its dataset: {shown}{more}; "
                           f"overwrite=true would delete them with the old dataset: move them out "
                           f"(or choose another output)")
    if readers := live_readers(path):
        more = f" and {len(readers) - 1} more reader{'s' * (len(readers) > 2)}" if len(readers) > 1 else ""
        raise DatasetError(f"{path} is being read by {readers[0]}{more}: overwrite=true would change "
                           f"the data under that run; wait until it ends, or choose another output")


class DatasetWriter:
    """Write samples (mappings of field name -> array) into a new sharded dataset at ``path``.

    >>> with DatasetWriter("out/ds", shard_bytes=64 * 2**20) as w:   # doctest: +SKIP
    ...     w.append({"x": np.zeros((3, 64), np.float32), "y": np.int64(7)})

    The schema comes from the first sample unless given; a leading dimension of 0 is fine.
    Big-endian input is converted to little-endian (the only byte order on disk).

    ``attributes`` (a JSON object, also settable until ``close`` as ``writer.attributes``) go into
    the manifest for readers (a text dataset's tokenizer); ``add_file`` ships a file beside the
    shards (its tokenizer.json), published with them and checked by verify.
    """

    def __init__(self, path: str | os.PathLike[str], *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 schema: Schema | None = None, overwrite: bool = False,
                 attributes: Mapping[str, Any] | None = None):
        if shard_bytes < 8:
            raise DatasetError(f"shard_bytes={shard_bytes} is invalid: must be >= 8 "
                               f"(try shard_bytes={DEFAULT_SHARD_BYTES})")
        self.path = Path(path).absolute()
        if self.path.is_symlink():
            # output=LINK overwrite=true replaces the dataset the link names, and the link stays:
            # the new dataset is built beside that one (a rename never crosses file systems) and
            # renamed in where it lies. Renaming onto the link itself failed ("Is a directory").
            self.path = self.path.resolve()
        self.shard_bytes = shard_bytes
        self.overwrite = overwrite
        self._schema: dict[str, FieldSpec] | None = None
        self._stats: dict[str, list[int]] = {}
        self._ranges: dict[str, list[int]] = {}  # integer scalar field -> [min, max] value
        if schema is not None:
            self._set_schema(dict(schema))
        check_output(self.path, overwrite)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_siblings(self.path)
            self._tmp = _make_sibling_dir(self.path, "tmp")
        except OSError as e:  # a read-only or full file system fails here, before any sample
            raise WriteError(_io_message(self.path, e, 0)) from e
        try:
            self._lock = _hold_new_lock(self._tmp)
        except OSError as e:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise WriteError(_io_message(self.path, e, 0)) from e
        _OWN_TEMP_DIRS.add(self._tmp)
        self._shards: list[ShardInfo] = []
        self._shard: _ShardFile | None = None
        self._is_open = True
        self.num_samples = 0
        self.num_bytes = 0  # data bytes written so far, padding included
        self.manifest: Manifest | None = None
        self.attributes: dict[str, Any] = dict(attributes or {})
        self._files: list[FileInfo] = []

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- public ------------------------------------------------------------------------------

    @property
    def schema(self) -> dict[str, FieldSpec] | None:
        return None if self._schema is None else dict(self._schema)

    def append(self, sample: Mapping[str, Any]) -> None:
        """Validate one sample against the schema, then write it (rolling the shard if needed)."""
        if not self._is_open:
            raise DatasetError(f"writer for {self.path} is closed: open a new DatasetWriter")
        arrays = self._check(sample)
        with self._io_errors_explained():
            self._write(arrays)

    def _write(self, arrays: list[np.ndarray]) -> None:
        specs = self._schema or {}
        sizes = [pad8(a.nbytes) for a in arrays]
        if sum(sizes) > self.shard_bytes:
            raise DatasetError(f"sample {self.num_samples} is {sum(sizes)} bytes, more than "
                               f"shard_bytes={self.shard_bytes}: raise shard_bytes")
        if self._shard is not None and self._shard.num_bytes + sum(sizes) > self.shard_bytes:
            self._finish_shard()
        if self._shard is None:
            self._shard = _ShardFile(self._tmp, len(self._shards), specs)
        self._shard.write(arrays)
        for name, a in zip(specs, arrays, strict=True):
            if name in self._stats:
                stats = self._stats[name]
                stats[0], stats[1] = min(stats[0], len(a)), max(stats[1], len(a))
            elif name in self._ranges:
                value, bounds = int(a), self._ranges[name]
                bounds[0], bounds[1] = min(bounds[0], value), max(bounds[1], value)
        self.num_samples += 1
        self.num_bytes += sum(sizes)

    def add_file(self, name: str, data: bytes) -> None:
        """Ship ``data`` as file ``name`` of the dataset (a tokenizer.json): written into the temp
        directory now, published with the shards, listed in the manifest with its checksum."""
        if not self._is_open:
            raise DatasetError(f"writer for {self.path} is closed: open a new DatasetWriter")
        problem = extra_file_name_problem(name)
        if problem is None and any(f.name == name for f in self._files):
            problem = "was already added"
        if problem is not None:
            raise DatasetError(f"extra file name {name!r} {problem}: choose another name")
        with self._io_errors_explained():
            _write_synced(self._tmp / name, data)
        self._files.append(FileInfo(name, len(data), xxhash.xxh3_64_hexdigest(data)))

    def close(self) -> Path:
        """Finish the last shard, write the manifest, fsync, and rename into place."""
        if self.manifest is not None:
            return self.path
        if not self._is_open:
            raise DatasetError(f"writer for {self.path} was aborted: nothing to publish")
        try:
            if self.num_samples == 0:
                raise DatasetError(f"no samples were written to {self.path}: nothing published "
                                   f"(is the input empty?)")
            with self._io_errors_explained():
                if self._shard is not None:
                    self._finish_shard()
                manifest = self._build_manifest()
                _write_synced(self._tmp / MANIFEST_NAME, manifest.to_json().encode())
                # Unlinked, the lock file still holds the flock through its descriptor; removers
                # leave a directory without one alone, so the dataset never carries it.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._tmp / LOCK_NAME)
                fsync_dir(self._tmp)
                self._publish()
            self.manifest, self._is_open = manifest, False
            self._release()  # published: the directory is the dataset now
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Discard everything written; nothing appears at ``path``."""
        was_open, self._is_open = self._is_open, False
        if self._shard is not None:
            self._shard.discard()
            self._shard = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        if was_open:
            self._release()

    def _release(self) -> None:
        _OWN_TEMP_DIRS.discard(self._tmp)
        if self._lock is not None:
            os.close(self._lock)

    @contextlib.contextmanager
    def _io_errors_explained(self) -> Iterator[None]:
        """The file system failing under the writer: discard everything, then one clear error."""
        try:
            yield
        except OSError as e:
            # What reached the file system: finished shards, both files, and the open shard's data
            # (self.num_bytes counts the open shard's samples too: adding both counted them twice).
            written = sum(s.data_bytes + s.index_bytes for s in self._shards)
            written += self._shard.num_bytes if self._shard else 0
            message = _io_message(self.path, e, written)  # the space left at the failure: removing
            self.abort()  # the partial copy frees it again, and the message then told of room to spare
            raise WriteError(message) from e

    # -- internals ---------------------------------------------------------------------------

    def _set_schema(self, schema: dict[str, FieldSpec]) -> None:
        if not schema:
            raise DatasetError("the schema has no fields: a sample needs at least one")
        self._schema = schema
        self._stats = {n: [2**63, 0] for n, s in schema.items() if not s.is_scalar}
        self._ranges = {n: [2**64, -(2**64)] for n, s in schema.items()
                        if s.is_scalar and np.issubdtype(s.np_dtype, np.integer)}

    def _check(self, sample: Mapping[str, Any]) -> list[np.ndarray]:
        """Contiguous little-endian arrays in schema order, or SchemaMismatchError."""
        number = self.num_samples
        if not isinstance(sample, Mapping):
            raise SchemaMismatchError(
                f"sample {number} is a {type(sample).__name__}, expected a mapping of field "
                f"name -> array (e.g. {{'x': array}})", sample=number)
        arrays = {_check_name(name, number): _as_array(value, number, name)
                  for name, value in sample.items()}
        if self._schema is None:
            self._set_schema(_infer_schema(arrays, number))
        schema = self._schema or {}
        _check_field_names(schema, arrays, number)
        return [_check_field(spec, arrays[name], number, name) for name, spec in schema.items()]

    def _finish_shard(self) -> None:
        assert self._shard is not None  # internal invariant, not user input
        self._shards.append(self._shard.finish())
        self._shard = None

    def _build_manifest(self) -> Manifest:
        stats = {n: FieldStats(lo, hi) for n, (lo, hi) in self._stats.items()}
        ranges = {n: ValueRange(lo, hi) for n, (lo, hi) in self._ranges.items()}
        return Manifest(dict(self._schema or {}), tuple(self._shards), stats, self.shard_bytes,
                        ranges, _as_json_object(self.attributes, self.path), tuple(self._files))

    def _publish(self) -> None:
        check_output(self.path, self.overwrite)
        old: Path | None = None
        if self.path.exists():
            # A directory cannot be replaced atomically by rename: move the old dataset aside
            # first, so at every instant `path` is either the old dataset, absent, or the new one.
            old = _make_sibling_dir(self.path, "old")
            try:
                os.replace(self.path, old)  # Linux renames a directory onto an empty one
            except OSError:
                old.rmdir()  # still empty: nothing is left beside the dataset
                raise
        os.rename(self._tmp, self.path)
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class _ShardFile:
    """The shard being written: its open data file, running hash and index arrays."""

    def __init__(self, tmp: Path, number: int, schema: Mapping[str, FieldSpec]):
        self.schema = schema
        self.data_name, self.index_name = shard_file_names(number)
        self.data_path, self.index_path = tmp / self.data_name, tmp / self.index_name
        self._file: IO[bytes] = open(self.data_path, "xb")  # noqa: SIM115 closed in finish/discard
        self._hasher = new_hasher()
        # array('q') holds machine ints compactly: no per-sample Python objects even for 1e8 rows.
        self._offsets = [array.array("q") for _ in schema]
        self._leading = {n: array.array("q") for n, s in schema.items() if not s.is_scalar}
        self.num_samples = 0
        self.num_bytes = 0

    def write(self, arrays: list[np.ndarray]) -> None:
        for (name, spec), a, offsets in zip(self.schema.items(), arrays, self._offsets,
                                            strict=True):
            offsets.append(self.num_bytes)
            if not spec.is_scalar:
                self._leading[name].append(len(a))
            self._put(a.reshape(-1).view(np.uint8))  # flat bytes of a C-contiguous array
            self._put(_ZEROS[:pad8(a.nbytes) - a.nbytes])
        self.num_samples += 1

    def _put(self, buf: Any) -> None:
        self._file.write(buf)
        self._hasher.update(buf)
        self.num_bytes += memoryview(buf).nbytes

    def finish(self) -> ShardInfo:
        """Flush + fsync the data file, then write the index after it; return the manifest entry."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        arrays = [*self._offsets, *self._leading.values()]
        index = encode_index_head(self.schema, self.num_samples, self.num_bytes) + b"".join(
            np.asarray(a, dtype="<i8").tobytes() for a in arrays)
        _write_synced(self.index_path, index)
        return ShardInfo(
            data_file=self.data_name, index_file=self.index_name, num_samples=self.num_samples,
            data_bytes=self.num_bytes, index_bytes=len(index),
            data_xxh3_64=self._hasher.hexdigest(),
            index_xxh3_64=xxhash.xxh3_64_hexdigest(index),
        )

    def discard(self) -> None:
        # On a full disk close() fails again flushing the buffer (it still closes the descriptor);
        # that error must not stop the abort from removing the temp directory.
        with contextlib.suppress(OSError):
            self._file.close()


def _as_json_object(attributes: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The attributes as they will read back from the manifest (a tuple becomes a list, an int
    key a string), so the writer's manifest equals the reader's; anything JSON cannot hold (a
    numpy number, NaN) is refused by name."""
    try:
        text = json.dumps(dict(attributes), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"attributes of {path} cannot be stored as JSON ({e}): use str, int, "
                           f"float, bool, None, lists and dicts with str keys") from e
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _check_name(name: object, number: int) -> str:
    if not isinstance(name, str) or not name:
        raise SchemaMismatchError(f"sample {number}: field name {name!r} is not a non-empty "
                                  f"string", sample=number)
    return name


def _infer_schema(arrays: Mapping[str, np.ndarray], number: int) -> dict[str, FieldSpec]:
    schema = {}
    for name, a in arrays.items():
        try:
            schema[name] = FieldSpec.of(a)
        except DatasetError as e:
            raise SchemaMismatchError(f"sample {number}, field {name!r}: {e}", sample=number,
                                      field=name) from e
    return schema


def _as_array(value: Any, number: int, name: str) -> np.ndarray:
    """A numpy view of a field value (numpy array, torch CPU tensor, Python scalar)."""
    try:
        a = np.asarray(value)
    except Exception as e:  # torch raises RuntimeError for grad/GPU tensors, TypeError for others
        raise SchemaMismatchError(
            f"sample {number}, field {name!r}: cannot be read as an array ({e}); pass a numpy "
            f"array or a CPU tensor (.detach().cpu())", sample=number, field=name) from e
    if a.dtype.byteorder == ">":
        # The disk holds little-endian only: convert explicitly rather than store a second order.
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _check_field_names(schema: Schema, arrays: Mapping[str, np.ndarray], number: int) -> None:
    for name in schema:
        if name not in arrays:
            raise SchemaMismatchError(
                f"sample {number}, field {name!r}: missing (the schema has fields "
                f"{', '.join(schema)})", sample=number, field=name)
    for name in arrays:
        if name not in schema:
            raise SchemaMismatchError(
                f"sample {number}, field {name!r}: not in the schema (fields: "
                f"{', '.join(schema)}); drop it, or give an explicit schema", sample=number,
                field=name)


def _check_field(spec: FieldSpec, a: np.ndarray, number: int, name: str) -> np.ndarray:
    try:
        actual_dtype = dtype_name(a.dtype)
    except DatasetError as e:
        raise SchemaMismatchError(f"sample {number}, field {name!r}: {e}", sample=number,
                                  field=name) from e
    shape_ok = a.shape[1:] == spec.trailing if a.ndim == len(spec.shape) else False
    if actual_dtype != spec.dtype or not shape_ok:
        hint = (f"convert with .astype(np.{spec.dtype})" if actual_dtype != spec.dtype else
                "reshape it; only the leading dimension may vary between samples")
        raise SchemaMismatchError(
            f"sample {number}, field {name!r}: expected {spec}, got {describe_array(a)}: {hint} "
            f"(the schema comes from sample 0 unless given explicitly)", sample=number,
            field=name)
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return a if a.flags.c_contiguous else a.copy(order="C")


def _io_message(path: Path, error: OSError, written: int) -> str:
    """One line: the output, the system's reason, how far the writer got, the space, the fix."""
    cause = error.strerror or str(error)
    if error.filename and not str(error.filename).startswith(str(path.parent)):
        cause += f" ({error.filename})"  # a path outside the output's directory says where
    try:
        free = f", {human_bytes(shutil.disk_usage(existing_ancestor(path)).free)} free there"
    except OSError:
        free = ""
    fix = {errno.ENOSPC: "free space on that file system, or choose another output",
           errno.EDQUOT: "your quota there is used up: free some, or choose another output",
           errno.EROFS: "that file system is read-only: choose another output",
           errno.EACCES: "you may not write there: choose another output"}.get(
        error.errno or 0, "check the output directory, or choose another output")
    if written == 0:
        return (f"cannot write {path}: {cause} before any data was written{free}; nothing was "
                f"published ({fix})")
    return (f"cannot write {path}: {cause} after {human_bytes(written)} of data{free}; nothing was published "
            f"and the partial copy was removed ({fix})")


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent: where to ask for the free space of a future path."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def human_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def remove_stale_siblings(path: Path) -> list[Path]:
    """Remove what killed writers left beside ``path``: ``.<any name>.tmp-*`` directories whose
    lock this process can take, and ``.<name>.old-*`` ones once ``path`` exists (a publish moves the old
    dataset there, renames the new one in, then deletes it; before ``path`` exists again, an old
    one may be the only copy of the previous dataset). Returns what was removed."""
    removed = []
    # Any writer's: a prepare killed while writing another output of this directory left its
    # temp directory here too, and the lock tells a dead writer's from a live one's just as well.
    # Only names a writer gives (_make_sibling_dir: 8 hex digits), never a look-alike of the user's.
    for candidate in sorted(path.parent.glob(".*.tmp-*")):
        if not _WRITER_TEMP.fullmatch(candidate.name):
            continue
        fd = None if candidate in _OWN_TEMP_DIRS else _take_lock(candidate / LOCK_NAME)
        if fd is None:
            continue  # a live writer's, or one nobody can judge
        try:
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
        finally:
            os.close(fd)
    if path.exists():
        for old in sorted(path.parent.glob(f".{path.name}.old-*")):
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed


def _take_lock(lock_file: Path) -> int | None:
    """An fd holding the exclusive flock of an existing lock file; None if it is held, missing,
    not ours to open, or the file system has no flock."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: a live writer holds it; others: no flock here
        os.close(fd)
        return None
    return fd


# flock errors that mean "this file system has no flock" (Lustre without -o flock: ENOSYS; NFS
# without a lock manager: ENOLCK), not a failure to write.
_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


def _hold_new_lock(tmp: Path) -> int | None:
    """Create ``tmp/.lock`` already locked; None where the file system has no flock (the
    directory then has no ``.lock``, and other writers leave it alone).

    Locked under another name and renamed: a remover opens ``.lock`` only, so it can never take
    the lock between this process creating the file and locking it.
    """
    staging = tmp / f"{LOCK_NAME}-new"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        os.unlink(staging)
        if e.errno in _NO_FLOCK:
            return None
        raise
    try:
        os.rename(staging, tmp / LOCK_NAME)
    except OSError:
        os.close(fd)
        raise
    return fd


_WRITER_TEMP = re.compile(r"\..+\.tmp-[0-9a-f]{8}")  # what _make_sibling_dir names a temp directory


def _make_sibling_dir(path: Path, tag: str) -> Path:
    """``.<name>.<tag>-<random>`` next to ``path``: same filesystem, so the final rename is atomic.

    Not tempfile.mkdtemp: its mode 0700 would survive the rename and hide the dataset from other
    users; os.mkdir(0o777) lets the umask decide, as for any directory the user creates.
    """
    for _ in range(100):
        candidate = path.parent / f".{path.name}.{tag}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir(mode=0o777)
            return candidate
        except FileExistsError:
            continue
    raise DatasetError(f"cannot create a temporary directory next to {path}")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
