"""One run per run directory: rank 0 holds a lock on it for as long as the job trains.

Two runs writing one directory at once interleave metrics, overwrite each other's checkpoints and
leave a summary that belongs to neither. So rank 0 takes an exclusive ``flock`` on
``RUN/.switchyard.lock`` before anything else and keeps it until its process ends; a second run
that starts there while the first is alive is refused, naming the holder. The kernel drops the
lock when its process dies (a crash, SIGKILL, a node gone), so a requeue or a rerun that resumes
the directory takes it again without cleanup. The submitting side asks first (``check_free``),
so the usual case is refused before anything is queued.

The checkpoint directory (``checkpoint.dir``, when it is not the run directory's own) is held the
same way: two runs given one ``checkpoint.dir`` would otherwise publish, prune and resume each
other's checkpoints.

flock works across the nodes of a shared file system that supports it (NFSv4, Lustre mounted with
``flock``, GPFS); on one that does not, the lock only sees processes of the same node.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from orchestrator.config import ConfigError

LOCK_NAME = ".switchyard.lock"


class RunDirInUseError(ConfigError):
    """Another live run holds this run directory."""

    holder = "another run"  # who, as its lock file says


@contextlib.contextmanager
def hold(run_dir: Path, owner: str, key: str = "hydra.run.dir") -> Iterator[None]:
    """Hold the directory's lock (``owner`` says who, for the other run's error; ``key`` is the
    config key that named the directory)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock_or_explain(fd, run_dir, key)
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def check_free(run_dir: Path, key: str = "hydra.run.dir") -> None:
    """Refuse now if a live run holds ``run_dir``; takes nothing and creates nothing."""
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run ever held it
    try:
        _lock_or_explain(fd, run_dir, key, shared=True)
    finally:
        os.close(fd)


def holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock now (as its holder wrote it), or None."""
    try:
        check_free(run_dir)
    except RunDirInUseError as e:
        return e.holder
    return None


_FIX = {
    "hydra.run.dir": "overwrite each other's checkpoints and metrics (try hydra.run.dir=<a new "
                     "directory>, or wait until that run ends to resume it)",
    "checkpoint.dir": "publish, prune and resume each other's checkpoints (try checkpoint.dir=<a new "
                      "directory>; to start from that run's checkpoints, checkpoint.resume_from=<its "
                      "checkpoint.dir> once it has ended)",
}


def _lock_or_explain(fd: int, run_dir: Path, key: str, shared: bool = False) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another run"
        error = RunDirInUseError(
            f"{key}={str(run_dir)!r} is in use by {owner}: two runs in one directory would "
            f"{_FIX[key]}")
        error.holder = owner
        raise error from None
