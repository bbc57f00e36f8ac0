"""Readers advertise the datasets they hold open, so that an overwrite is refused while one reads.

A run's rank 0 holds a *lease* on each dataset it trains or evaluates on: the file
``.<NAME>.readers/<random>.lock`` beside dataset directory ``NAME``, holding a line that says who
reads (job, pid, host, run directory), with an exclusive ``flock`` for as long as the run lives.
``check_output`` (``jobs.prepare overwrite=true``, ``DatasetWriter(overwrite=True)``) asks
``live_readers`` first: a lease whose lock it cannot take belongs to a live reader, and the
overwrite is refused naming it; one it can take was left by a reader that died (the kernel drops
a dead process's lock, on any node), and is removed.

Beside the dataset, not in it: a publish replaces the dataset directory whole, the directory holds
only what the dataset owns (``foreign_files``), and the lease must outlive neither. Not in the
run directory: a writer could not find every run. flock reaches across the nodes of a shared file
system that supports it (NFSv4, Lustre mounted with ``flock``, GPFS), as the run directory's lock
does (``orchestrator.launch.run_lock``). Where the lease cannot be made (the dataset's folder is
read-only to the run, or the file system has no flock) the run reads without one: the readers'
own check (``ShardedDataset.check_unchanged``, at each epoch's start) still stops a run whose
dataset was replaced, naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

SUFFIX = ".lock"
# flock errors that mean "this file system has no flock", not a held lock (as sharding.writer's)
_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


def readers_dir(dataset: str | os.PathLike[str]) -> Path:
    """``.<NAME>.readers`` beside the dataset, symbolic links resolved: a run given a link and a
    writer given the directory (or another link) find the same leases."""
    real = Path(dataset).expanduser().absolute().resolve()
    return real.parent / f".{real.name}.readers"


@contextlib.contextmanager
def hold(dataset: str | os.PathLike[str], owner: str) -> Iterator[bool]:
    """Hold a lease on ``dataset`` for the ``with`` block; ``owner`` names the reader in a
    writer's refusal. Yields whether a lease is held (False: see the module's docstring)."""
    lease = _take(readers_dir(dataset), owner)
    try:
        yield lease is not None
    finally:
        if lease is not None:
            fd, path = lease
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # the last reader's: an empty folder is not left behind


def live_readers(dataset: str | os.PathLike[str]) -> list[str]:
    """Who holds a lease on ``dataset`` now (their owner lines); the leases of dead readers are
    removed on the way."""
    folder = readers_dir(dataset)
    try:
        leases = sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))
    except OSError:
        return []  # no folder: nobody ever leased it
    return [owner for lease in leases if (owner := _owner_if_live(lease)) is not None]


def _take(folder: Path, owner: str) -> tuple[int, Path] | None:
    """Create a locked lease in ``folder``: locked under a staging name, then renamed, so a
    writer (which opens ``*.lock`` only) never takes the lock between the creation and the lock
    and removes a live reader's lease as stale."""
    name = secrets.token_hex(8)
    staging, lease = folder / f"{name}.new", folder / f"{name}{SUFFIX}"
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return None  # a folder the run may not write: it reads without a lease
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, owner.encode(), 0)
        os.rename(staging, lease)
    except OSError as e:
        os.close(fd)
        with contextlib.suppress(OSError):
            staging.unlink()
        if e.errno in _NO_FLOCK:
            return None
        raise
    return fd, lease


def _owner_if_live(lease: Path) -> str | None:
    try:
        fd = os.open(lease, os.O_RDONLY)
    except OSError:
        return None  # gone meanwhile: its reader ended
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a live reader holds it
            return os.pread(fd, 512, 0).decode(errors="replace").strip() or f"a reader ({lease})"
        except OSError:
            return None  # no flock here: no lease can be judged, none blocks
        with contextlib.suppress(OSError):
            lease.unlink()  # its reader died without removing it
        return None
    finally:
        os.close(fd)
