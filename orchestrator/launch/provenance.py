"""What a run ran: the code snapshot, the git commit and its diff, the config's hash, the versions.

Written at submission into the run directory (``provenance.json``, the diff beside it as
``provenance.diff``), shown by ``switchyard show``. A checkpoint records the part a resume must
share (``for_checkpoint``: the snapshot's hash and torch's version); ``resume_change`` says what
differs when a run continues from a checkpoint written under other code.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import atomic
from orchestrator.config import ClusterConfig
from orchestrator.launch import snapshot

PROVENANCE_FILE = "provenance.json"
DIFF_FILE = "provenance.diff"
_GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Origin:
    """What the submitting side sees once per submission (a sweep's points share it)."""

    git_commit: str | None  # None: not a git checkout, or git is not installed
    git_dirty: bool | None
    git_diff: str  # `git diff HEAD`: tracked files' uncommitted changes
    versions: dict[str, str | None]


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA and NCCL as this process has them (CUDA/NCCL only once torch is
    imported: a `switchyard run` submission never imports it)."""
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": None,
                                    "cuda": None, "nccl": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = str(torch.__version__)
        found["cuda"] = torch.version.cuda
        try:
            nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        except (RuntimeError, AttributeError):
            nccl = None
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl and str(nccl)
    else:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["torch"] = importlib.metadata.version("torch")
    return found


def origin(cwd: Path | None = None) -> Origin:
    """Git state of the working directory's checkout, else of the one Switchyard runs from."""
    where = cwd or Path.cwd()
    commit = _git(where, "rev-parse", "HEAD")
    if commit is None:
        where = snapshot.own_root()
        commit = _git(where, "rev-parse", "HEAD")
    status = _git(where, "status", "--porcelain") if commit else None
    diff = (_git(where, "diff", "HEAD") or "") if commit else ""
    return Origin(commit.strip() if commit else None, bool(status.strip()) if status is not None else None,
                  diff, versions())


def config_hash(config_text: str) -> str:
    return hashlib.sha256(config_text.encode()).hexdigest()


def write_diff(folder: Path, found: Origin) -> Path | None:
    """The uncommitted diff, once per submission; None when the tree is clean."""
    if not found.git_diff:
        return None
    path = folder / DIFF_FILE
    atomic.write_text(path, found.git_diff, durable=False)  # submit-time: resubmitting rewrites it
    return path


def record(run_dir: Path, snap: snapshot.Snapshot | None, config_text: str, found: Origin,
           diff_path: Path | None) -> dict[str, Any]:
    """``RUN/provenance.json``; returns what it wrote."""
    code = {"hash": snap.hash, "path": str(snap.path), "files": len(snap.files)} if snap else None
    data = {"snapshot": code,
            "git": {"commit": found.git_commit, "dirty": found.git_dirty,
                    "diff": str(diff_path) if diff_path else None},
            "config_sha256": config_hash(config_text), "versions": found.versions,
            "submitted_at": time.time()}
    atomic.write_text(Path(run_dir) / PROVENANCE_FILE, json.dumps(data, indent=1), durable=False)
    return data


def read(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(run_dir) / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lines(data: dict[str, Any]) -> list[str]:
    """What ``switchyard show`` prints of a run's provenance."""
    snap, git, found = data.get("snapshot"), data.get("git") or {}, data.get("versions") or {}
    out = [f"code snapshot: {snap['hash'][:16]} ({snap['path']})" if snap
           else "code snapshot: none (the job imported the working tree)"]
    if git.get("commit"):
        changes = git["diff"] or "untracked files only"
        dirty = f" + uncommitted changes ({changes})" if git.get("dirty") else ""
        out.append(f"git: {git['commit'][:12]}{dirty}")
    out.append(f"config sha256: {str(data.get('config_sha256'))[:16]}")
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v))
    return out


# ------------------------------------------------------------------------------------------------
# At checkpoint and resume (on the ranks)


def for_checkpoint() -> dict[str, Any]:
    """The provenance a checkpoint records: the snapshot this rank imports from, torch's version."""
    snap = snapshot.current()
    return {"code_hash": snap.hash if snap else None, "snapshot": str(snap.path) if snap else None,
            "torch": versions()["torch"]}


def resume_change(saved: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any] | None:
    """What differs between the code a checkpoint was written under and this run's; None when
    nothing that can be compared does. A checkpoint from before provenance, or a run outside a
    snapshot (``cluster=local``), has no code hash: only torch's version is compared then."""
    if not saved:
        return None
    change: dict[str, Any] = {}
    if saved.get("code_hash") and now.get("code_hash") and saved["code_hash"] != now["code_hash"]:
        change["code_hash"] = [saved["code_hash"], now["code_hash"]]
        old = snapshot.read_manifest(Path(saved["snapshot"])) if saved.get("snapshot") else None
        new = snapshot.read_manifest(Path(now["snapshot"])) if now.get("snapshot") else None
        if old is not None and new is not None:
            change["files"] = snapshot.changed_files(old, new)
    if saved.get("torch") != now.get("torch"):
        change["torch"] = [saved.get("torch"), now.get("torch")]
    return change or None


def describe_change(change: dict[str, Any]) -> str:
    parts = []
    if "code_hash" in change:
        old, new = change["code_hash"]
        files = change.get("files")
        if files is None:
            listed = " (the old snapshot is gone: its files cannot be listed)"
        else:
            listed = f"; files that differ: {', '.join(files[:10])}{' ...' if len(files) > 10 else ''}"
        parts.append(f"code snapshot {old[:12]} -> {new[:12]}{listed}")
    if "torch" in change:
        parts.append(f"torch {change['torch'][0]} -> {change['torch'][1]}")
    return "; ".join(parts)


def at_submission(cluster: ClusterConfig, targets: Sequence[str], run_dir: Path,
                  config_text: str) -> snapshot.Snapshot | None:
    """A single job's code snapshot (``cluster=slurm``, unless ``cluster.snapshot.enabled=false``)
    and its ``provenance.json``. Local and debug jobs start at once, from the working tree: no
    snapshot, the rest is recorded."""
    take = cluster.mode == "slurm" and cluster.snapshot.enabled
    snap = snapshot.take(cluster.snapshot, targets) if take else None
    found = origin()
    record(run_dir, snap, config_text, found, write_diff(run_dir, found))
    return snap
