"""``switchyard snapshots prune``: remove the code snapshots no job still needs.

A snapshot (``launch.snapshot``) is kept while the registry says a job may still import it: a job
not yet ended (queued, running, requeued), and every job of a sweep from the last
``--older-than-days`` (a failed one can be resubmitted, and it resumes under its own snapshot). Of
the rest, one taken or reused within that time is kept too (a submission recorded in another
registry, or none). Everything else in the store goes; the store's other files are never touched.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import IO

from orchestrator.config import SnapshotConfig
from orchestrator.entry import PathError, existing_dir, shown
from orchestrator.launch import provenance, snapshot
from orchestrator.registry.db import Registry
from orchestrator.sweeps.status import CommandError

DAY_S = 24 * 3600.0
SNAPSHOT_NAME = re.compile(r"[0-9a-f]{64}|\.tmp-[0-9a-f]{12}-.*")  # a snapshot, or one being written


def in_use(registry: Registry, since: float) -> set[str]:
    """The hashes of the snapshots the registry's jobs may still import (``Registry.snapshots_in_use``;
    jobs recorded without provenance are looked up in their run directory)."""
    hashes, unrecorded = registry.snapshots_in_use(since)
    for run_dir in unrecorded:
        origin = provenance.read(run_dir)
        snap = origin.get("snapshot") if origin else None
        if isinstance(snap, dict):
            hashes.add(str(snap.get("hash")))
    return hashes


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def store_root(store: str | Path | None) -> Path | None:
    """The store to prune: ``store`` as given, which must be a snapshot store, or the default one;
    None when the default one was never made. A mistyped ``--store`` once removed "0 snapshots"
    and exited 0, and a directory that is not a store would have lost its hash-named directories."""
    if store is None:
        root = snapshot.store_dir(SnapshotConfig())
        return root if root.is_dir() else None
    try:
        root = existing_dir("--store", str(store), what="a snapshot store")
    except PathError as e:
        raise CommandError(str(e)) from e
    entries = [entry.name for entry in root.iterdir()]
    if entries and not any(SNAPSHOT_NAME.fullmatch(name) for name in entries):
        raise CommandError(f"--store {shown(str(store))} is not a snapshot store: none of its "
                           f"{len(entries)} entries is a snapshot (a directory named by the sha256 of "
                           f"its files); give cluster.snapshot.dir's directory")
    return root


def cmd_prune(registry: Registry, store: str | None, older_than_days: float, dry_run: bool,
              as_json: bool, out: IO[str] = sys.stdout, now: float | None = None) -> int:
    if not older_than_days >= 0:
        raise CommandError(f"--older-than-days {older_than_days} is invalid: give the days a snapshot "
                         f"nobody uses is kept, 0 or more (try --older-than-days 30)")
    now = time.time() if now is None else now
    root = store_root(store)
    if root is None:
        print(f"nothing to prune: no snapshot was taken into the default store "
              f"{snapshot.store_dir(SnapshotConfig())} yet (another store: --store DIR)", file=out)
        return 0
    keep = in_use(registry, now - older_than_days * DAY_S)
    age_s = older_than_days * DAY_S
    sizes = {p: size_bytes(p) for p in snapshot.prune(root, keep, age_s, dry_run=True, now=now)}
    if not dry_run:  # sized first: a removed snapshot has no size left to count
        sizes = {p: sizes.get(p, 0) for p in snapshot.prune(root, keep, age_s, now=now)}
    removed = sizes
    if as_json:
        print(json.dumps({"store": str(root), "dry_run": dry_run, "kept_in_use": sorted(keep),
                          "removed": [p.name for p in removed], "bytes": sum(removed.values())}), file=out)
        return 0
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {len(removed)} snapshot(s) ({sum(removed.values()) / 2**20:.1f} MiB) from {root}; "
          f"kept those of jobs not yet ended and of sweeps from the last {older_than_days:g} days "
          f"({len(keep)} in use), and any taken or reused since then", file=out)
    for p in removed:
        print(f"  {p.name}", file=out)
    return 0
