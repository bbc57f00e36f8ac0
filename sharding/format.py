"""The on-disk layout of a sharded dataset: one place that knows every byte.

A dataset is a directory::

    manifest.json           schema, per-shard sample counts, sizes and xxh3-64 checksums
    shard-00000.bin         data: every sample's fields, C order, little-endian, 8-byte aligned
    shard-00000.idx         index: header, field table, per-field offset and leading-size arrays
    shard-00001.bin ...

``docs/format.md`` documents the layout byte by byte; the constants and ``struct`` formats here are
its executable form. The writer and the reader both go through the functions in this module, so
the two cannot disagree about an offset. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

# ------------------------------------------------------------------------------------------------
# Errors


class DatasetError(Exception):
    """A dataset cannot be written or read; the message names the path and what to do."""


class SchemaMismatchError(DatasetError):
    """A sample does not match the schema; the message names the sample number and the field."""

    def __init__(self, message: str, *, sample: int | None = None, field: str | None = None):
        super().__init__(message)
        self.sample = sample
        self.field = field


class WriteError(DatasetError):
    """The file system refused the writer (full, over quota, read-only); the message names the
    output, the bytes written, the space left and the fix, and nothing was published."""


class DatasetChangedError(DatasetError):
    """The dataset at a path was replaced (or its manifest rewritten) after it was opened: what the
    path holds now is not what the reader started with; the message names the path."""


class CorruptDatasetError(DatasetError):
    """A file is missing, truncated, foreign or damaged; the message names the file and shard."""

    def __init__(self, message: str, *, file: str | None = None, shard: int | None = None):
        super().__init__(message)
        self.file = file
        self.shard = shard


REBUILD_HINT = "re-create the dataset with python -m jobs.prepare, or restore the file from a copy"


def corrupt(path: Path | str, shard: int | None, what: str,
            fix: str = REBUILD_HINT) -> CorruptDatasetError:
    """One format for every corruption message: ``shard K (FILE): what; how to fix``."""
    where = f"shard {shard} ({path})" if shard is not None else str(path)
    return CorruptDatasetError(f"{where}: {what}; {fix}", file=str(path), shard=shard)


# ------------------------------------------------------------------------------------------------
# Dtypes: stored by name, always little-endian on disk

# Every numpy numeric dtype with a fixed, portable size, plus bool. longdouble is left out: its
# size and layout differ between platforms, so a file written on one could not be read on another.
SUPPORTED_DTYPES: tuple[str, ...] = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
)


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The little-endian numpy dtype stored under ``name``; refuses names outside the format."""
    if name not in SUPPORTED_DTYPES:
        raise DatasetError(
            f"dtype {name!r} is not supported: use one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return np.dtype(name).newbyteorder("<")


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The name a dtype is stored under, whatever its byte order; refuses unsupported dtypes."""
    name = dtype.name if dtype.kind in "biufc" else str(dtype)
    if name not in SUPPORTED_DTYPES:
        raise DatasetError(
            f"dtype {dtype.str!r} is not supported: convert to one of "
            f"{', '.join(SUPPORTED_DTYPES)} (e.g. with .astype(np.float32))"
        )
    return name


def pad8(num_bytes: int) -> int:
    """``num_bytes`` rounded up to a multiple of 8: every field and array starts 8-byte aligned."""
    return (num_bytes + 7) & ~7


# ------------------------------------------------------------------------------------------------
# Schema


@dataclass(frozen=True)
class FieldSpec:
    """One named field of every sample: a dtype and a shape whose leading dimension may vary.

    ``shape`` is ``()`` for a scalar, or ``(None, *trailing)`` where ``None`` is the leading
    dimension, which varies per sample (0 allowed) and is stored in the index.
    ``FieldSpec("float32", (None, 64))`` is ``float32[*, 64]``;
    ``FieldSpec("int64")`` is ``int64[]``.
    """

    dtype: str
    shape: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        if self.shape and (self.shape[0] is not None or any(
            not isinstance(d, int) or d < 0 for d in self.shape[1:]
        )):
            raise DatasetError(
                f"field shape {self.shape!r} is invalid: use () for a scalar or "
                f"(None, d1, d2, ...) with d_i >= 0, None marking the per-sample leading dimension"
            )

    @property
    def is_scalar(self) -> bool:
        return not self.shape

    @property
    def trailing(self) -> tuple[int, ...]:
        """The fixed dimensions after the leading one (empty for scalars and 1-D fields)."""
        return tuple(int(d) for d in self.shape[1:] if d is not None)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return dtype_from_name(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes per leading row (per sample for a scalar)."""
        return self.np_dtype.itemsize * math.prod(self.trailing)

    def __str__(self) -> str:
        dims = ["*", *map(str, self.trailing)] if self.shape else []
        return f"{self.dtype}[{', '.join(dims)}]"

    @staticmethod
    def of(array: np.ndarray) -> FieldSpec:
        """The spec an array implies: a 0-d array is a scalar, otherwise its leading dim varies."""
        shape: tuple[int | None, ...] = () if array.ndim == 0 else (None, *array.shape[1:])
        return FieldSpec(dtype_name(array.dtype), shape)


Schema = Mapping[str, FieldSpec]


def describe_array(array: np.ndarray) -> str:
    """``float64[3, 64]``: how error messages show what a sample actually holds."""
    return f"{array.dtype.name}[{', '.join(map(str, array.shape))}]"


# ------------------------------------------------------------------------------------------------
# Index file (.idx)

# PNG-style magic: the high first byte and the trailing \n catch 7-bit and text-mode copies.
INDEX_MAGIC = b"\x89SWYIDX\n"
FORMAT_VERSION = 1
FLAG_LITTLE_ENDIAN = 1 << 0  # data and index are little-endian (always set in version 1)
FLAG_ALIGNED_8 = 1 << 1  # every field in the data file starts at a multiple of 8 (always set)
KNOWN_FLAGS = FLAG_LITTLE_ENDIAN | FLAG_ALIGNED_8

# magic, version, flags, num_samples, data_bytes, index_bytes, num_fields, field_table_bytes,
# arrays_offset, reserved: 64 bytes, see docs/format.md.
HEADER = struct.Struct("<8sIIQQQIIQQ")
FIELD_RECORD = struct.Struct("<HBBI")  # name_len, dtype_len, kind, num_trailing
KIND_SCALAR, KIND_VARIABLE = 0, 1
OFFSET_DTYPE = np.dtype("<i8")  # byte offsets and leading sizes: 64-bit, so no 4 GiB ceiling


@dataclass(frozen=True)
class IndexHeader:
    """The fixed part of an index file plus its field table, decoded and checked."""

    num_samples: int
    data_bytes: int
    index_bytes: int
    schema: dict[str, FieldSpec]
    arrays_offset: int
    flags: int = KNOWN_FLAGS

    def offsets_at(self, field_number: int) -> int:
        """Byte position in the index of field ``field_number``'s int64 offset array."""
        return self.arrays_offset + 8 * self.num_samples * field_number

    def leading_at(self, field_name: str) -> int:
        """Byte position in the index of a variable field's int64 leading-size array."""
        variable = [n for n, s in self.schema.items() if not s.is_scalar]
        slot = len(self.schema) + variable.index(field_name)
        return self.arrays_offset + 8 * self.num_samples * slot


def encode_field_table(schema: Schema) -> bytes:
    """Field records, each 8-byte aligned: sizes, name + dtype name (padded), trailing dims."""
    parts: list[bytes] = []
    for name, spec in schema.items():
        name_b, dtype_b = name.encode("utf-8"), spec.dtype.encode("ascii")
        kind = KIND_SCALAR if spec.is_scalar else KIND_VARIABLE
        text = name_b + dtype_b
        parts += [
            FIELD_RECORD.pack(len(name_b), len(dtype_b), kind, len(spec.trailing)),
            text + b"\0" * (pad8(len(text)) - len(text)),
            np.asarray(spec.trailing, dtype=OFFSET_DTYPE).tobytes(),
        ]
    return b"".join(parts)


def index_bytes_for(schema: Schema, num_samples: int) -> int:
    """The exact size of an index file: header + field table + one int64 array per slot."""
    num_arrays = len(schema) + sum(not s.is_scalar for s in schema.values())
    return HEADER.size + len(encode_field_table(schema)) + 8 * num_samples * num_arrays


def encode_index_head(schema: Schema, num_samples: int, data_bytes: int) -> bytes:
    """Header + field table: everything in an index file before its arrays."""
    table = encode_field_table(schema)
    header = HEADER.pack(
        INDEX_MAGIC, FORMAT_VERSION, KNOWN_FLAGS, num_samples, data_bytes,
        index_bytes_for(schema, num_samples), len(schema), len(table), HEADER.size + len(table), 0,
    )
    return header + table


def index_head_encoder(schema: Schema) -> Callable[[ShardInfo], bytes | None]:
    """The exact header and field table a shard's index holds, for many shards of one schema
    (the field table is encoded once); None for a shard whose manifest entry no valid index can
    match (its index_bytes do not fit its sample count), which only the full check can explain.

    A reader compares these bytes with the file's: equal bytes pass every check
    decode_index_head and the manifest comparison make, in one comparison per shard.
    """
    table = encode_field_table(schema)
    num_arrays = len(schema) + sum(not s.is_scalar for s in schema.values())

    def head(info: ShardInfo) -> bytes | None:
        index_bytes = HEADER.size + len(table) + 8 * info.num_samples * num_arrays
        if index_bytes != info.index_bytes:
            return None
        return HEADER.pack(
            INDEX_MAGIC, FORMAT_VERSION, KNOWN_FLAGS, info.num_samples, info.data_bytes,
            index_bytes, len(schema), len(table), HEADER.size + len(table), 0,
        ) + table

    return head


def decode_index_head(buf: bytes | mmap.mmap, path: Path | str, shard: int | None) -> IndexHeader:
    """Parse and check an index file's header and field table (at least the first 64 bytes).

    Checks magic, version and flags before trusting any other number; raises
    CorruptDatasetError naming the file and shard on anything unexpected.
    """
    if len(buf) < HEADER.size:
        raise corrupt(path, shard, f"index is {len(buf)} bytes, shorter than its "
                                   f"{HEADER.size}-byte header (truncated)")
    (magic, version, flags, num_samples, data_bytes, index_bytes, num_fields, table_bytes,
     arrays_offset, _reserved) = HEADER.unpack_from(buf)
    if magic != INDEX_MAGIC:
        raise corrupt(path, shard, f"bad magic {magic!r}, expected {INDEX_MAGIC!r}: "
                                   f"not a Switchyard index file")
    if version != FORMAT_VERSION:
        raise corrupt(path, shard, f"format version {version} is not supported by this reader "
                                   f"(it reads version {FORMAT_VERSION})",
                      fix="upgrade Switchyard, or re-create the dataset with this version")
    if flags & ~KNOWN_FLAGS or not flags & FLAG_LITTLE_ENDIAN:
        raise corrupt(path, shard, f"flags {flags:#x} name features this reader does not know "
                                   f"(it knows {KNOWN_FLAGS:#x})")
    if arrays_offset != HEADER.size + table_bytes or len(buf) < arrays_offset:
        raise corrupt(path, shard, f"field table of {table_bytes} bytes does not fit the "
                                   f"{len(buf)}-byte index (arrays at {arrays_offset})")
    schema = _decode_field_table(buf[HEADER.size:arrays_offset], num_fields, path, shard)
    header = IndexHeader(num_samples, data_bytes, index_bytes, schema, arrays_offset, flags)
    if index_bytes_for(schema, num_samples) != index_bytes:
        raise corrupt(path, shard, f"header says {index_bytes} bytes but {num_samples} samples "
                                   f"of this schema need {index_bytes_for(schema, num_samples)}")
    return header


def _decode_field_table(table: bytes, num_fields: int, path: Path | str,
                        shard: int | None) -> dict[str, FieldSpec]:
    schema: dict[str, FieldSpec] = {}
    pos = 0
    try:
        for _ in range(num_fields):
            name_len, dtype_len, kind, ndim = FIELD_RECORD.unpack_from(table, pos)
            pos += FIELD_RECORD.size
            name = table[pos:pos + name_len].decode("utf-8")
            dtype = table[pos + name_len:pos + name_len + dtype_len].decode("ascii")
            pos += pad8(name_len + dtype_len)
            dims = np.frombuffer(table, OFFSET_DTYPE, count=ndim, offset=pos).tolist()
            pos += 8 * ndim
            if kind not in (KIND_SCALAR, KIND_VARIABLE) or (kind == KIND_SCALAR and ndim):
                raise DatasetError(f"field {name!r} has kind {kind} with {ndim} trailing dims")
            schema[name] = FieldSpec(dtype, () if kind == KIND_SCALAR else (None, *dims))
    except (struct.error, ValueError, DatasetError) as e:
        raise corrupt(path, shard, f"field table is unreadable: {e}") from e
    if pos != len(table):
        raise corrupt(path, shard, f"field table is {len(table)} bytes, its {num_fields} "
                                   f"records use {pos}")
    return schema


def read_index_head(path: Path, shard: int | None) -> IndexHeader:
    """Read only the header and field table of an index file (never its arrays)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
            if len(head) == HEADER.size and head[:8] == INDEX_MAGIC:
                table_bytes = HEADER.unpack(head)[7]
                head += f.read(table_bytes)
    except FileNotFoundError as e:
        raise corrupt(path, shard, "index file is missing") from e
    except OSError as e:
        raise corrupt(path, shard, f"index file cannot be read: {e}") from e
    return decode_index_head(head, path, shard)


# ------------------------------------------------------------------------------------------------
# Checksums

CHECKSUM_ALGORITHM = "xxh3_64"
_HASH_CHUNK_BYTES = 8 * 2**20
# One read buffer per thread, reused for every file: allocating 8 MiB per file made verify on
# many small shards 13-16x slower than cat (the allocation and its page faults, not the hash).
_BUFFERS = threading.local()


def new_hasher() -> xxhash.xxh3_64:
    """The streaming hash used for every file (xxh3-64: ~10 GB/s, far faster than the disk)."""
    return xxhash.xxh3_64()


def read_buffer() -> memoryview:
    """This thread's reusable 8 MiB read buffer (callers must not keep views across calls).

    An anonymous map on 2 MiB pages where the kernel allows: reads into a reused bytearray ran
    at a third of the speed (2.3 GB/s against 7.5 GB/s from the page cache here), the copy
    paying a TLB miss per 4 KiB page.
    """
    buf: memoryview | None = getattr(_BUFFERS, "view", None)
    if buf is None:
        region = mmap.mmap(-1, _HASH_CHUNK_BYTES)
        with contextlib.suppress(AttributeError, OSError):  # no THP: still correct, slower
            region.madvise(mmap.MADV_HUGEPAGE)
        buf = _BUFFERS.view = memoryview(region)
    return buf


def file_checksum(path: Path | str, *, dir_fd: int | None = None) -> str:
    """xxh3-64 of a file as 16 hex digits, read in 8 MiB chunks into this thread's buffer."""
    hasher = new_hasher()
    buf = read_buffer()
    fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        while num_read := os.readv(fd, [buf]):
            hasher.update(buf[:num_read])
    finally:
        os.close(fd)
    return hasher.hexdigest()


# ------------------------------------------------------------------------------------------------
# Manifest (manifest.json)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "switchyard-sharded-dataset"


# What the writer names shard files (``shard_file_names``), and nothing else in a dataset.
SHARD_FILE = re.compile(r"shard-\d+\.(bin|idx)")


def shard_file_names(shard: int) -> tuple[str, str]:
    """Data and index file names of shard number ``shard``."""
    return f"shard-{shard:05d}.bin", f"shard-{shard:05d}.idx"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest records it: file names, sample count, sizes, checksums."""

    data_file: str
    index_file: str
    num_samples: int
    data_bytes: int
    index_bytes: int
    data_xxh3_64: str
    index_xxh3_64: str


@dataclass(frozen=True)
class FieldStats:
    """Smallest and largest leading size a variable field takes over the whole dataset."""

    min_leading: int
    max_leading: int


@dataclass(frozen=True)
class ValueRange:
    """Smallest and largest value an integer scalar field takes (labels: checked against a model's
    class count before any job starts)."""

    min_value: int
    max_value: int


@dataclass(frozen=True)
class FileInfo:
    """A file the dataset ships besides its shards (a tokenizer.json): name, size, checksum."""

    name: str
    num_bytes: int
    xxh3_64: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs before touching a shard; JSON on disk."""

    schema: dict[str, FieldSpec]
    shards: tuple[ShardInfo, ...]
    field_stats: dict[str, FieldStats] = field(default_factory=dict)
    shard_bytes: int = 0
    value_ranges: dict[str, ValueRange] = field(default_factory=dict)  # absent in older manifests
    # What the samples mean to a trainer (a text dataset's tokenizer and vocabulary, an image
    # dataset's class names): a JSON object, absent from the file when empty, so manifests and
    # fingerprints of datasets without it are byte for byte what they were.
    attributes: dict[str, Any] = field(default_factory=dict)
    files: tuple[FileInfo, ...] = ()  # extra files of the dataset, checked by verify

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def to_json(self) -> str:
        fields = []
        for name, spec in self.schema.items():
            entry: dict[str, Any] = {"name": name, "dtype": spec.dtype, "shape": list(spec.shape)}
            if name in self.field_stats:
                stats = self.field_stats[name]
                entry.update(min_leading=stats.min_leading, max_leading=stats.max_leading)
            if name in self.value_ranges:
                values = self.value_ranges[name]
                entry.update(min_value=values.min_value, max_value=values.max_value)
            fields.append(entry)
        doc = {
            "format": MANIFEST_FORMAT,
            "version": FORMAT_VERSION,
            "checksum": CHECKSUM_ALGORITHM,
            "num_samples": self.num_samples,
            "shard_bytes": self.shard_bytes,
            "fields": fields,
            "shards": [vars(s) for s in self.shards],
        }
        if self.attributes:
            doc["attributes"] = self.attributes
        if self.files:
            doc["files"] = [vars(f) for f in self.files]
        return json.dumps(doc, indent=1) + "\n"

    @staticmethod
    def from_json(text: str, path: Path | str) -> Manifest:
        """Parse and check a manifest; CorruptDatasetError naming ``path`` if anything is off."""
        try:
            doc = json.loads(text)
            _check_manifest_header(doc)
            schema, stats, ranges = _parse_fields(doc["fields"])
            shards = tuple(_parse_shard(s) for s in doc["shards"])
            manifest = Manifest(schema, shards, stats, int(doc.get("shard_bytes", 0)), ranges,
                                _parse_attributes(doc.get("attributes", {})),
                                _parse_files(doc.get("files", []), shards))
            if manifest.num_samples != doc["num_samples"]:
                raise ValueError(f"num_samples {doc['num_samples']} != the shards' sum "
                                 f"{manifest.num_samples}")
        except (ValueError, KeyError, TypeError, DatasetError) as e:
            raise corrupt(path, None, f"manifest is invalid: {e}") from e
        return manifest


def _check_manifest_header(doc: Any) -> None:
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"'format' is not {MANIFEST_FORMAT!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"version {doc.get('version')!r} is not supported by this reader "
                         f"(it reads version {FORMAT_VERSION})")
    if doc.get("checksum") != CHECKSUM_ALGORITHM:
        raise ValueError(f"checksum {doc.get('checksum')!r} is not {CHECKSUM_ALGORITHM!r}")


def _parse_fields(entries: Sequence[Any]
                  ) -> tuple[dict[str, FieldSpec], dict[str, FieldStats], dict[str, ValueRange]]:
    schema: dict[str, FieldSpec] = {}
    stats: dict[str, FieldStats] = {}
    ranges: dict[str, ValueRange] = {}
    for e in entries:
        shape = tuple(None if d is None else int(d) for d in e["shape"])
        schema[str(e["name"])] = FieldSpec(str(e["dtype"]), shape)
        if "min_leading" in e:
            stats[str(e["name"])] = FieldStats(int(e["min_leading"]), int(e["max_leading"]))
        if "min_value" in e:
            ranges[str(e["name"])] = ValueRange(int(e["min_value"]), int(e["max_value"]))
    if not schema:
        raise ValueError("no fields")
    return schema, stats, ranges


def _parse_shard(entry: Mapping[str, Any]) -> ShardInfo:
    info = ShardInfo(
        data_file=str(entry["data_file"]), index_file=str(entry["index_file"]),
        num_samples=int(entry["num_samples"]), data_bytes=int(entry["data_bytes"]),
        index_bytes=int(entry["index_bytes"]), data_xxh3_64=str(entry["data_xxh3_64"]),
        index_xxh3_64=str(entry["index_xxh3_64"]),
    )
    for name in (info.data_file, info.index_file):
        # A manifest names files inside its own directory only: never ../ or an absolute path.
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"shard file name {name!r} is not a plain file name")
    if min(info.num_samples, info.data_bytes, info.index_bytes) < 0:
        raise ValueError(f"shard {info.data_file} has a negative count or size")
    return info


def _parse_attributes(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"'attributes' is a {type(value).__name__}, expected a JSON object")
    return value


def _parse_files(entries: Any, shards: Sequence[ShardInfo]) -> tuple[FileInfo, ...]:
    if not isinstance(entries, list):
        raise ValueError(f"'files' is a {type(entries).__name__}, expected a list")
    files = tuple(FileInfo(str(e["name"]), int(e["num_bytes"]), str(e["xxh3_64"]))
                  for e in entries)
    shard_names = {name for s in shards for name in (s.data_file, s.index_file)}
    seen: set[str] = set()
    for info in files:
        problem = extra_file_name_problem(info.name)
        if problem is None and (info.name in shard_names or info.name in seen):
            problem = "is listed twice (or is also a shard file)"
        if problem is not None:
            raise ValueError(f"extra file name {info.name!r} {problem}")
        if info.num_bytes < 0:
            raise ValueError(f"extra file {info.name!r} has a negative size")
        seen.add(info.name)
    return files


def extra_file_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an extra file of a dataset, or None: a plain, visible file name
    that is neither the manifest nor named like a shard file (those names are the writer's)."""
    if os.path.basename(name) != name or name in ("", ".", ".."):
        return "is not a plain file name (no '/' or '..')"
    if name.startswith("."):
        return "starts with '.' (the writer's own temp and lock files do)"
    if name == MANIFEST_NAME or SHARD_FILE.fullmatch(name):
        return "is the manifest's or a shard file's name"
    return None


def read_manifest(root: Path) -> Manifest:
    """Load ``root/manifest.json``; a clear error if ``root`` is not a finished dataset."""
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise DatasetError(f"{root}: no dataset here (not a directory); create one with "
                           f"python -m jobs.prepare input=... output={root}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise corrupt(path, None, "manifest is missing: this directory is not a dataset, or its "
                                  "writer did not finish (datasets only appear when complete)"
                      ) from e
    except (OSError, UnicodeDecodeError) as e:
        raise corrupt(path, None, f"manifest cannot be read: {e}") from e
    return Manifest.from_json(text, path)


def fingerprint(manifest: Manifest) -> str:
    """16 hex digits that change whenever the schema, shard counts or any file's bytes change.

    Ranks compare it at startup so they cannot silently train on different copies of the data.
    """
    doc: dict[str, Any] = {
        "schema": [[n, s.dtype, list(s.shape)] for n, s in manifest.schema.items()],
        "shards": [[s.num_samples, s.data_xxh3_64, s.index_xxh3_64] for s in manifest.shards],
    }
    # Only when present, so every dataset written without them keeps its fingerprint. With them,
    # two copies tokenized differently (another tokenizer.json) differ, as their tokens mean
    # different things even where the shards happen to be equal.
    if manifest.attributes:
        doc["attributes"] = manifest.attributes
    if manifest.files:
        doc["files"] = [[f.name, f.xxh3_64] for f in manifest.files]
    return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True).encode())


def check_schemas_equal(expected: Schema, actual: Schema, path: Path | str,
                        shard: int | None) -> None:
    """The index's field table must repeat the manifest's schema exactly, field order included."""
    if list(expected.items()) == list(actual.items()):
        return
    differ = [f"field {n!r} is {actual[n]} in the index, {expected[n]} in the manifest"
              for n in expected if n in actual and actual[n] != expected[n]]
    differ += [f"field {n!r} is only in the manifest" for n in expected if n not in actual]
    differ += [f"field {n!r} is only in the index" for n in actual if n not in expected]
    raise corrupt(path, shard, f"index schema {format_schema(actual)} differs from the manifest's "
                               f"{format_schema(expected)}: "
                               f"{'; '.join(differ) or 'the fields are in another order'}")


def format_schema(schema: Schema | Iterable[tuple[str, FieldSpec]]) -> str:
    """``{x: float32[*, 64], y: int64[]}``."""
    items = schema.items() if isinstance(schema, Mapping) else schema
    return "{" + ", ".join(f"{n}: {s}" for n, s in items) + "}"


def foreign_files(path: Path) -> list[str]:
    """Names of the entries in dataset directory ``path`` that its dataset does not own: anything
    but the manifest, the shard files and extra files (a tokenizer.json) it lists, and files named
    like shards (a dataset whose manifest no longer lists them still wrote them)."""
    owned = {MANIFEST_NAME}
    try:
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_text(), path / MANIFEST_NAME)
    except (OSError, UnicodeDecodeError, DatasetError):
        manifest = None  # damaged: only the names the writer gives its files count as owned
    if manifest is not None:
        owned |= {name for s in manifest.shards for name in (s.data_file, s.index_file)}
        # Only as files: a directory named like one is not what the dataset wrote.
        owned |= {f.name for f in manifest.files if (path / f.name).is_file()}
    return sorted(p.name for p in path.iterdir()
                  if p.name not in owned and not (SHARD_FILE.fullmatch(p.name) and p.is_file()))
