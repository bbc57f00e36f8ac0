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
from sharding.reader import check_shard_structure


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
    return manifest, problems


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
