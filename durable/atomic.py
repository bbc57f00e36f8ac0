"""Files that are either whole or absent: temp file in the same directory, fsync, rename.

A process killed mid-write (preemption, the OOM killer, a full disk) leaves the previous version
or the new one, never a prefix of the new one. Everything in ``orchestrator/`` that other
processes read (checkpoints, summaries, rendezvous and telemetry files, sweep state) goes through
here, and ``sharding``'s writer publishes its datasets with ``fsync_dir``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_write(path: Path, *, binary: bool = False, durable: bool = True) -> Iterator[IO[Any]]:
    """Write through the yielded file; it replaces ``path`` only if the block completes.

    ``durable`` also fsyncs the directory, so the rename survives a machine crash (checkpoints);
    small status files that are rewritten often can skip that.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, *, durable: bool = True) -> None:
    with atomic_write(path, durable=durable) as f:
        f.write(text)


def write_json(path: Path, obj: object, *, indent: int | None = None, durable: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=indent) + ("\n" if indent else ""), durable=durable)


def fsync_dir(directory: Path) -> None:
    """POSIX makes a rename, or any new entry of a directory, durable only once the directory is
    fsynced. The one copy: checkpoints here and the dataset writer (sharding) both call it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
