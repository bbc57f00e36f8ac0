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
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sharding.format import (
    MANIFEST_NAME,
    REBUILD_HINT,
    CorruptDatasetError,
    DatasetError,
    Manifest,
    ShardInfo,
    file_checksum,
    fingerprint,
    read_manifest,
)
from sharding.reader import ShardedDataset, check_shard_structure


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
    problems = _verify_file_names(root, manifest)
    for shard, info in enumerate(manifest.shards):
        problems += _verify_shard(root, shard, info, manifest)
    if not problems:  # the figures are read from the index and data; only sound shards can tell
        problems += _verify_field_figures(root, manifest)
    return manifest, problems


# What the writer names shard files; any such file in the directory belongs to a listed shard.
_SHARD_FILE = re.compile(r"shard-\d+\.(bin|idx)")


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
    unlisted = sorted(p.name for p in root.iterdir() if _SHARD_FILE.fullmatch(p.name) and p.name not in owner)
    problems += [Problem(str(root / name), None, (
        f"not listed in the manifest ({len(manifest.shards)} shards, {manifest.num_samples} "
        f"samples): the dataset leaves its samples out (its entry deleted or overwritten?)"))
        for name in unlisted]
    return problems


def _verify_field_figures(root: Path, manifest: Manifest) -> list[Problem]:
    """The manifest's per-field figures against what the shards hold: each variable field's
    smallest and largest leading size, each integer scalar field's value range. Readers trust
    them (collate stacks a field whose sizes are equal; the trainer checks labels against the
    class count), so a changed figure would mislead them without failing any checksum."""
    where = str(root / MANIFEST_NAME)
    problems = _misplaced_figures(manifest, where)
    for shard, info in enumerate(manifest.shards):
        if 0 < manifest.shard_bytes < info.data_bytes:  # the writer rolls over before this size
            problems.append(Problem(where, shard, (
                f"data_bytes {info.data_bytes} exceed the manifest's shard_bytes "
                f"{manifest.shard_bytes}, which its writer never lets a shard pass")))
    schema, shards = manifest.schema, manifest.shards
    with ShardedDataset(root, manifest) as ds:
        for name, stats in manifest.field_stats.items():
            if name in schema and not schema[name].is_scalar:
                ends = np.cumsum([s.num_samples for s in shards])[:-1]
                found = [(int(a.min()), int(a.max())) if a.size else None
                         for a in np.split(ds.leading_sizes(name), ends)]
                problems += _compare_range(
                    root, manifest, name, "min_leading/max_leading", "leading sizes", "index",
                    (stats.min_leading, stats.max_leading), found)
        for name, values in manifest.value_ranges.items():
            spec = schema.get(name)
            if spec is not None and spec.is_scalar and np.issubdtype(spec.np_dtype, np.integer):
                found = [ds.shard_value_range(shard, name) for shard in range(len(shards))]
                problems += _compare_range(
                    root, manifest, name, "min_value/max_value", "values", "data",
                    (values.min_value, values.max_value), found)
    return problems


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
        actual = file_checksum(path)
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


def run_verify_cli(path: str) -> int:
    """Print a human-readable report; return 0 when everything matches, 1 otherwise."""
    root = Path(path).absolute()
    manifest, problems = _verify(root)
    if manifest is not None and not problems:
        print(
            f"OK: {manifest.num_samples} samples in {len(manifest.shards)} shards, checksums "
            f"match ({root}, fingerprint {fingerprint(manifest)})"
        )
        return 0
    print(f"FAILED: {len(problems)} problem{'s' if len(problems) != 1 else ''} in {root}")
    for problem in problems:
        print(f"  {problem}")
    if manifest is not None:
        print(f"To fix: {REBUILD_HINT}.")
    return 1
