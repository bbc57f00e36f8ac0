"""`switchyard snapshots prune`: the store loses what no job still needs, never what one does."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import pytest

from orchestrator.registry.db import Job, Observation, Registry
from orchestrator.sweeps.prune import DAY_S, cmd_prune
from orchestrator.sweeps.status import CommandError


def name(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()  # a snapshot's directory is its hash


LIVE, ENDED, LEGACY, RECENT = name("live"), name("ended"), name("legacy"), name("recent")


def job(reg: Registry, tmp_path: Path, num: int, snap: str, ended: bool, recorded: bool = True) -> None:
    run_dir = tmp_path / "runs" / str(num)
    run_dir.mkdir(parents=True)
    sweep = reg.create_sweep(app="train", command=f"x={num}", sweep_dir=str(run_dir), executor="slurm",
                             entry_path="")
    reg.add_jobs([Job(sweep, 0, [f"x={num}"], str(run_dir), {}, None)])
    attempt = reg.claim(sweep, [0])[0]  # SUBMITTING: not ended
    if ended:
        reg.observe([Observation(attempt, "COMPLETED", exit_code=0, ended_at=time.time())])
    record = {"snapshot": {"hash": snap, "path": str(tmp_path / "store" / snap), "files": 1}}
    if recorded:
        reg.record_provenance(sweep, {0: record})
    else:  # submitted before the registry kept provenance: only its run directory says
        (run_dir / "provenance.json").write_text(json.dumps(record))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    for entry in (LIVE, ENDED, LEGACY, RECENT, ".tmp-0123456789ab-dead", "notes", ".tmp-notes"):
        (store / entry).mkdir(parents=True)
        (store / entry / "a.py").write_text("x = 1\n")
    with Registry(tmp_path / "reg.db") as reg:
        job(reg, tmp_path, 1, LIVE, ended=False)
        job(reg, tmp_path, 2, ENDED, ended=True)
        job(reg, tmp_path, 3, LEGACY, ended=False, recorded=False)
    return store


def prune(tmp_path: Path, store: Path, now: float, dry_run: bool = False) -> str:
    out = io.StringIO()
    with Registry(tmp_path / "reg.db") as reg:
        assert cmd_prune(reg, str(store), 30, dry_run, as_json=False, out=out, now=now) == 0
    return out.getvalue()


def test_prune_removes_only_what_no_job_needs_once_it_is_old(tmp_path: Path, store: Path) -> None:
    later = time.time() + 40 * DAY_S  # every sweep above is now 40 days old
    os.utime(store / RECENT, (later - DAY_S, later - DAY_S))  # taken or reused a day ago
    listed = prune(tmp_path, store, later, dry_run=True)
    assert "would remove 2 snapshot(s)" in listed and ENDED in listed and ".tmp-0123456789ab-dead" in listed
    assert (store / ENDED).is_dir()  # a dry run removes nothing
    text = prune(tmp_path, store, later)
    assert text.startswith("removed 2 snapshot(s)"), text
    # kept: a job not yet ended (recorded in the registry, or only in its run directory), one taken
    # or reused recently, and what is not the store's own
    assert sorted(p.name for p in store.iterdir()) == sorted([LIVE, LEGACY, RECENT, "notes", ".tmp-notes"])


def test_a_recent_sweeps_snapshots_are_kept_though_its_jobs_ended(tmp_path: Path, store: Path) -> None:
    """A failed job of last week's sweep can be resubmitted: it resumes under its own snapshot."""
    old = time.time() - 40 * DAY_S
    for entry in (ENDED, ".tmp-0123456789ab-dead"):  # untouched for 40 days
        os.utime(store / entry, (old, old))
    assert prune(tmp_path, store, time.time()).startswith("removed 1 snapshot(s)")  # the dead copy
    assert (store / ENDED).is_dir() and not (store / ".tmp-0123456789ab-dead").exists()


def test_a_negative_age_is_refused(tmp_path: Path, store: Path) -> None:
    with Registry(tmp_path / "reg.db") as reg, pytest.raises(CommandError, match="--older-than-days 30"):
        cmd_prune(reg, str(store), -1, False, as_json=False)


def test_a_snapshot_reused_by_a_submission_counts_as_new(tmp_path: Path) -> None:
    """A resubmission with unchanged code stores nothing new but reuses the old snapshot: its age
    starts again, so prune does not remove it from under the job just queued."""
    from orchestrator.config import SnapshotConfig
    from orchestrator.launch import snapshot

    config = SnapshotConfig(dir=str(tmp_path / "store"))
    taken = snapshot.take(config)
    old = time.time() - 40 * DAY_S
    os.utime(taken.path, (old, old))
    assert snapshot.prune(tmp_path / "store", set(), 30 * DAY_S, dry_run=True) == [taken.path]
    again = snapshot.take(config)
    assert again.path == taken.path and not again.created
    assert snapshot.prune(tmp_path / "store", set(), 30 * DAY_S) == [] and taken.path.is_dir()
