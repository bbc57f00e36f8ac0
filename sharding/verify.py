"""``switchyard verify PATH``: structure and every checksum, each failure named by file and shard.

Opening a dataset already checks magic, version and sizes; only verify reads every byte, because
hashing a large dataset takes as long as reading it once (xxh3 runs faster than the disk). Every
figure of the manifest is checked against what the files hold: per shard its files, sample count,
sizes and schema against the index header; the totals against the shards; the shard files in the
directory against the shards listed; each field's recorded leading sizes and values against the
index and data. A manifest edited by hand, or by a bad copy, is caught even where every checksum
it lists still matches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sharding.format import (
    MANIFEST_NAME,
    OFFSET_DTYPE,
    REBUILD_HINT,
    SHARD_FILE,
    CorruptDatasetError,
    DatasetError,
    Manifest,
    ShardInfo,
    file_checksum,
    fingerprint,
    foreign_files,
    index_head_encoder,
    new_hasher,
    read_buffer,
    read_manifest,
)
from sharding.reader import ShardedDataset, check_shard_structure

Range = tuple[int, int] | None  # a shard's smallest and largest figure; None: it has no samples
Figures = dict[str, Range]  # field name -> the shard's range of the figure the manifest records


@dataclass(frozen=True)
class Problem:
    """One failing file: which file, which shard (None for the manifest), and what is wrong."""

    file: str
    shard: int | None
    what: str

    def __str__(self) -> str:
        where = f"shard {self.shard}: {self.file}" if self.shard is not None else self.file
        return f"{where}: {self.what}"


def verify(path: str | os.PathLike[str]) -> list[Problem]:
    """Check the manifest, every shard's structure and every file's checksum; [] when all pass."""
    return _verify(Path(path).absolute())[1]


def _verify(root: Path) -> tuple[Manifest | None, list[Problem]]:
    try:
        manifest = read_manifest(root)
    except CorruptDatasetError as e:
        return None, [Problem(e.file or str(root / MANIFEST_NAME), None, _strip_location(e))]
    except DatasetError as e:
        return None, [Problem(str(root), None, str(e).removeprefix(f"{root}: "))]
    problems = _verify_file_names(root, manifest) + _verify_extra_files(root, manifest)
    figures: dict[int, Figures] = {}  # shard -> its figures, for shards that passed quickly
    head_of, layout = index_head_encoder(manifest.schema), _quick_layout(manifest)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for shard, info in enumerate(manifest.shards):
            found = _quick_shard(dir_fd, info, layout, head_of(info))
            if found is None:
                problems += _verify_shard(root, shard, info, manifest)
            else:
                figures[shard] = found
    finally:
        os.close(dir_fd)
    if not problems:  # the figures are read from the index and data; only sound shards can tell
        problems += _verify_field_figures(root, manifest, figures)
    return manifest, problems


def _figure_fields(manifest: Manifest) -> tuple[list[str], list[str]]:
    """(variable fields with recorded leading sizes, integer scalar fields with a value range)."""
    schema = manifest.schema
    leading = [n for n in manifest.field_stats if n in schema and not schema[n].is_scalar]
    values = [n for n in manifest.value_ranges if n in schema and schema[n].is_scalar
              and np.issubdtype(schema[n].np_dtype, np.integer)]
    return leading, values


class _QuickLayout(NamedTuple):
    """What the quick path needs of the schema, worked out once per verify, not per shard."""

    leading_slot: np.ndarray  # int64 [F]: each field's leading-size array, or 0 for a scalar
    is_scalar: np.ndarray  # bool [F, 1]
    row_bytes: np.ndarray  # int64 [F, 1], bytes per leading row, at least 1
    no_rows: np.ndarray | None  # bool [F, 1], fields whose rows take no bytes; None if none
    leading_names: list[str]  # fields with a recorded leading-size range
    leading_slots: np.ndarray  # int64 [L], their leading-size arrays
    value_figures: list[tuple[str, int, np.dtype[Any]]]  # (field, number, dtype) with a range


def _quick_layout(manifest: Manifest) -> _QuickLayout:
    schema = manifest.schema
    variable = [name for name, spec in schema.items() if not spec.is_scalar]
    slot = {name: len(schema) + k for k, name in enumerate(variable)}
    leading, values = _figure_fields(manifest)
    numbers = {name: k for k, name in enumerate(schema)}
    row_bytes = np.array([[spec.row_bytes] for spec in schema.values()], dtype=np.int64)
    return _QuickLayout(
        np.array([slot.get(name, 0) for name in schema], dtype=np.int64),
        np.array([[spec.is_scalar] for spec in schema.values()], dtype=np.bool_),
        np.maximum(row_bytes, 1),
        (row_bytes == 0) if (row_bytes == 0).any() else None,
        leading,
        np.array([slot[name] for name in leading], dtype=np.int64),
        [(name, numbers[name], schema[name].np_dtype) for name in values],
    )


_INT64_MAX = np.iinfo(np.int64).max


def _quick_shard(dir_fd: int, info: ShardInfo, layout: _QuickLayout, head: bytes | None
                 ) -> Figures | None:
    """Every check _verify_shard makes, and the shard's figures, from one read of each file
    into this thread's buffer: no map, Path or decoded header per shard, and one vectorised
    bounds check over all fields, so many small shards verify at the speed of their bytes. None
    when the shard needs the full check, which then names the problem: a file over half the
    buffer (4 MiB), or anything that differs."""
    buf = read_buffer()
    half = len(buf) // 2  # the index in the first half, the data in the second: both stay
    index = None if head is None else _read_whole(dir_fd, info.index_file, info.index_bytes, buf[:half])
    if head is None or index is None or index[:len(head)] != head or _xxh3(index) != info.index_xxh3_64:
        return None
    data = _read_whole(dir_fd, info.data_file, info.data_bytes, buf[half:])
    if data is None or _xxh3(data) != info.data_xxh3_64:
        return None
    num, size = info.num_samples, info.data_bytes
    if not num:
        return dict.fromkeys([*layout.leading_names, *(name for name, _, _ in layout.value_figures)])
    arrays = np.frombuffer(index, OFFSET_DTYPE, offset=len(head)).reshape(-1, num)  # [A, num]
    offsets = arrays[:len(layout.is_scalar)]  # int64 [F, num]
    rows = np.where(layout.is_scalar, 1, arrays[layout.leading_slot])  # int64 [F, num]
    # reader._check_bounds for every field at once. Viewed unsigned, a negative offset or row
    # count is huge, so one comparison each; rows are compared, never multiplied (a corrupt
    # leading size could overflow offset + rows * row_bytes into an in-bounds-looking value).
    room = (size - offsets) // layout.row_bytes  # int64 [F, num], rows that fit after offset
    if layout.no_rows is not None:
        room = np.where(layout.no_rows, _INT64_MAX, room)
    inside = offsets.view(np.uint64) <= np.uint64(size)
    inside &= (offsets & 7) == 0
    inside &= rows.view(np.uint64) <= room.view(np.uint64)  # room >= 0 wherever offset is inside
    if not inside.all():
        return None
    found: Figures = {}
    if layout.leading_names:
        picked = arrays[layout.leading_slots]  # int64 [L, num]
        lows, highs = picked.min(axis=1).tolist(), picked.max(axis=1).tolist()
        found.update(zip(layout.leading_names, zip(lows, highs, strict=True), strict=True))
    for name, number, dtype in layout.value_figures:
        values = np.frombuffer(data, dtype, count=size // dtype.itemsize)
        chosen = values[offsets[number] // dtype.itemsize]  # [num]
        found[name] = (int(chosen.min()), int(chosen.max()))
    return found


def _read_whole(dir_fd: int, name: str, size: int, buf: memoryview) -> memoryview | None:
    """The file's bytes, read into buf, if it has exactly `size` bytes and they fit (one byte
    more is asked for, so a longer file shows without a stat)."""
    if size >= len(buf):
        return None
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        done = 0
        while done <= size and (num_read := os.readv(fd, [buf[done:size + 1]])):
            done += num_read
        return buf[:size] if done == size else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _xxh3(view: memoryview) -> str:
    hasher = new_hasher()
    hasher.update(view)
    return hasher.hexdigest()


def _verify_file_names(root: Path, manifest: Manifest) -> list[Problem]:
    """Each shard's files are its own, and every shard file in the directory is listed: a shard
    entry copied over another (its samples read twice) or deleted (its samples gone, with
    num_samples lowered to match) passes every size and checksum check."""
    where, problems = str(root / MANIFEST_NAME), []
    owner: dict[str, int] = {}  # file name -> the first shard that lists it
    for shard, info in enumerate(manifest.shards):
        for key, name in (("data_file", info.data_file), ("index_file", info.index_file)):
            if name in owner:
                problems.append(Problem(where, shard, (
                    f"{key} {name!r} is also shard {owner[name]}'s: its samples would be read "
                    f"twice, and this shard's own files not at all")))
            owner.setdefault(name, shard)
    unlisted = sorted(p.name for p in root.iterdir() if SHARD_FILE.fullmatch(p.name) and p.name not in owner)
    problems += [Problem(str(root / name), None, (
        f"not listed in the manifest ({len(manifest.shards)} shards, {manifest.num_samples} "
        f"samples): the dataset leaves its samples out (its entry deleted or overwritten?)"))
        for name in unlisted]
    problems += [Problem(str(root / name), None, (
        "not part of the dataset: jobs.prepare overwrite=true refuses to replace a dataset while "
        "its directory holds other files (move it out)"))
        for name in foreign_files(root)]
    return problems


def _verify_extra_files(root: Path, manifest: Manifest) -> list[Problem]:
    """The files shipped beside the shards (a text dataset's tokenizer.json): a changed tokenizer
    would turn every stored token id into another word without any shard changing."""
    problems = []
    for info in manifest.files:
        path = root / info.name
        if not path.is_file():
            problems.append(Problem(str(path), None, "is missing (the manifest lists it)"))
            continue
        size = path.stat().st_size
        actual = file_checksum(path) if size == info.num_bytes else None
        if size != info.num_bytes:
            what = f"is {size} bytes, the manifest says {info.num_bytes}"
        elif actual != info.xxh3_64:
            what = (f"xxh3_64 checksum {actual} does not match the manifest's {info.xxh3_64}: the "
                    f"file's bytes changed (an edit, or another file copied over it)")
        else:
            continue
        problems.append(Problem(str(path), None, what))
    return problems


def _verify_field_figures(root: Path, manifest: Manifest, figures: dict[int, Figures]
                          ) -> list[Problem]:
    """The manifest's per-field figures against what the shards hold: each variable field's
    smallest and largest leading size, each integer scalar field's value range. Readers trust
    them (collate stacks a field whose sizes are equal; the trainer checks labels against the
    class count), so a changed figure would mislead them without failing any checksum.
    ``figures`` holds the shards already read; the others are read here."""
    where = str(root / MANIFEST_NAME)
    problems = _misplaced_figures(manifest, where)
    for shard, info in enumerate(manifest.shards):
        if 0 < manifest.shard_bytes < info.data_bytes:  # the writer rolls over before this size
            problems.append(Problem(where, shard, (
                f"data_bytes {info.data_bytes} exceed the manifest's shard_bytes "
                f"{manifest.shard_bytes}, which its writer never lets a shard pass")))
    leading, values = _figure_fields(manifest)
    with ShardedDataset(root, manifest) as ds:
        counts = [info.num_samples for info in manifest.shards]
        starts = np.cumsum([0, *counts[:-1]]).tolist()  # each shard's first global sample
        per_shard = [figures[shard] if shard in figures else
                     _shard_figures(ds, shard, starts[shard], counts[shard], leading, values)
                     for shard in range(len(manifest.shards))]
    for name in leading:
        stats = manifest.field_stats[name]
        problems += _compare_range(
            root, manifest, name, "min_leading/max_leading", "leading sizes", "index",
            (stats.min_leading, stats.max_leading), [found[name] for found in per_shard])
    for name in values:
        recorded = manifest.value_ranges[name]
        problems += _compare_range(
            root, manifest, name, "min_value/max_value", "values", "data",
            (recorded.min_value, recorded.max_value), [found[name] for found in per_shard])
    return problems


def _shard_figures(ds: ShardedDataset, shard: int, start: int, count: int, leading: list[str],
                   values: list[str]) -> Figures:
    """One shard's figures read through the dataset (a shard too large for the quick path);
    its samples are global ids [start, start + count)."""
    samples = np.arange(start, start + count, dtype=np.int64)
    found: Figures = {}
    for name in leading:
        sizes = ds.leading_sizes(name, samples)
        found[name] = (int(sizes.min()), int(sizes.max())) if sizes.size else None
    for name in values:
        found[name] = ds.shard_value_range(shard, name)
    return found


def _misplaced_figures(manifest: Manifest, where: str) -> list[Problem]:
    """Figures on a field that cannot have them: no reader would ever check them against data."""
    problems = []
    for name in manifest.field_stats:
        spec = manifest.schema.get(name)
        if spec is None or spec.is_scalar:
            problems.append(Problem(where, None, (
                f"field {name!r}: the manifest records min_leading/max_leading for "
                f"{'no such field' if spec is None else f'a scalar ({spec})'}; only fields with a "
                f"leading dimension have them")))
    for name in manifest.value_ranges:
        spec = manifest.schema.get(name)
        if spec is None or not spec.is_scalar or not np.issubdtype(spec.np_dtype, np.integer):
            problems.append(Problem(where, None, (
                f"field {name!r}: the manifest records min_value/max_value for "
                f"{'no such field' if spec is None else spec}; only integer scalar fields have them")))
    return problems


def _compare_range(root: Path, manifest: Manifest, name: str, keys: str, what: str, file_kind: str,
                   recorded: tuple[int, int], found: list[tuple[int, int] | None]) -> list[Problem]:
    """One Problem per shard whose figures fall outside the manifest's, naming its file; if none
    do, one for the manifest when its figures are not the shards' actual extremes."""
    problems = []
    for shard, actual in enumerate(found):
        if actual is not None and (actual[0] < recorded[0] or actual[1] > recorded[1]):
            info = manifest.shards[shard]
            file = info.index_file if file_kind == "index" else info.data_file
            problems.append(Problem(str(root / file), shard, (
                f"field {name!r}: {what} {actual[0]}..{actual[1]} in this {file_kind} file, outside "
                f"the manifest's {keys} {recorded[0]}/{recorded[1]}")))
    present = [a for a in found if a is not None]
    if present and not problems:
        overall = (min(lo for lo, _ in present), max(hi for _, hi in present))
        if overall != recorded:
            problems.append(Problem(str(root / MANIFEST_NAME), None, (
                f"field {name!r}: the manifest's {keys} {recorded[0]}/{recorded[1]} differ from "
                f"the {file_kind}'s {overall[0]}/{overall[1]}")))
    return problems


def _verify_shard(root: Path, shard: int, info: ShardInfo, manifest: Manifest) -> list[Problem]:
    problems = []
    try:
        check_shard_structure(root, shard, manifest)
    except CorruptDatasetError as e:
        problems.append(Problem(e.file or str(root), shard, _strip_location(e)))
    for name, expected in (
        (info.data_file, info.data_xxh3_64),
        (info.index_file, info.index_xxh3_64),
    ):
        path = root / name
        if not path.is_file():
            continue  # reported above as missing; there is nothing to hash
        actual = file_checksum(path)  # this thread's buffer, reused for every file
        if actual != expected:
            problems.append(
                Problem(
                    str(path),
                    shard,
                    (
                        f"xxh3_64 checksum {actual} does not match the manifest's {expected}: the "
                        f"file's bytes changed (bit rot, a partial copy or an edit)"
                    ),
                )
            )
    return problems


def _strip_location(error: CorruptDatasetError) -> str:
    """The message without its ``shard K (FILE): `` prefix and fix, which the report prints once."""
    text = str(error)
    prefix = (
        f"shard {error.shard} ({error.file}): " if error.shard is not None else (f"{error.file}: ")
    )
    return text.removeprefix(prefix).removesuffix(f"; {REBUILD_HINT}")


def verify_report(path: str) -> tuple[int, list[str]]:
    """The human-readable report's lines, and 0 when everything matches, 1 otherwise."""
    root = Path(path).absolute()
    manifest, problems = _verify(root)
    if manifest is not None and not problems:
        return 0, [
            f"OK: {manifest.num_samples} samples in {len(manifest.shards)} shards, checksums "
            f"match ({root}, fingerprint {fingerprint(manifest)})"
        ]
    lines = [f"FAILED: {len(problems)} problem{'s' if len(problems) != 1 else ''} in {root}"]
    lines += [f"  {problem}" for problem in problems]
    if manifest is not None:
        lines.append(f"To fix: {REBUILD_HINT}.")
    return 1, lines


def run_verify_cli(path: str, escape: Callable[[str], str] = str) -> int:
    """Print the report, each line through ``escape`` (the caller's terminal filter: the path and the
    problems come from the user and the files); return 0 when everything matches, 1 otherwise."""
    code, lines = verify_report(path)
    for line in lines:
        print(escape(line))
    return code
