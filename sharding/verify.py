"""``switchyard verify PATH``: structure and every checksum, each failure named by file and shard.

Opening a dataset already checks magic, version and sizes; only verify reads every byte, because
hashing a large dataset takes as long as reading it once (xxh3 runs faster than the disk).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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
    problems: list[Problem] = []
    for shard, info in enumerate(manifest.shards):
        problems += _verify_shard(root, shard, info, manifest)
    if not problems:  # the figures are read from the index and data; only sound shards can tell
        problems += _verify_field_figures(root, manifest)
    return manifest, problems


def _verify_field_figures(root: Path, manifest: Manifest) -> list[Problem]:
    """The manifest's per-field figures against what the shards hold: each variable field's
    smallest and largest leading size, each integer scalar field's value range. Readers trust
    them (collate stacks a field whose sizes are equal; the trainer checks labels against the
    class count), so a changed figure would mislead them without failing any checksum."""
    where, problems = str(root / MANIFEST_NAME), []
    for shard, info in enumerate(manifest.shards):
        if 0 < manifest.shard_bytes < info.data_bytes:  # the writer rolls over before this size
            problems.append(Problem(where, shard, (
                f"data_bytes {info.data_bytes} exceed the manifest's shard_bytes "
                f"{manifest.shard_bytes}, which its writer never lets a shard pass")))
    with ShardedDataset(root, manifest) as ds:
        for name, stats in manifest.field_stats.items():
            sizes = ds.leading_sizes(name)
            actual = (int(sizes.min()), int(sizes.max())) if sizes.size else None
            if actual is not None and actual != (stats.min_leading, stats.max_leading):
                problems.append(Problem(where, None, (
                    f"field {name!r}: the manifest's min_leading/max_leading "
                    f"{stats.min_leading}/{stats.max_leading} differ from the index's "
                    f"{actual[0]}/{actual[1]}")))
        for name, values in manifest.value_ranges.items():
            actual = ds.value_range(name, recorded=False)
            if actual != (values.min_value, values.max_value):
                problems.append(Problem(where, None, (
                    f"field {name!r}: the manifest's min_value/max_value {values.min_value}/"
                    f"{values.max_value} differ from the data's {actual[0]}/{actual[1]}")))
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
