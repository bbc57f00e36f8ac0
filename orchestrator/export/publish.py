"""The one way an export appears: written into ``.OUT.partial-PID-XXXX`` beside OUT, fsynced, then
renamed to OUT. A process killed at any moment leaves no OUT at all (or the previous one, with
``--overwrite``), only a hidden partial directory the next export to OUT removes. An export is
whole when OUT exists: ``export.json``, written last into the partial directory, says so.

Only OUT is ever replaced, and only with ``--overwrite``: never a directory the user did not name,
never one that holds the run or its checkpoints.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from durable.atomic import fsync_dir
from orchestrator.export.source import ExportError

PARTIAL = ".partial-"


def check_out(out: Path, overwrite: bool, protected: list[Path]) -> None:
    """Refuse an OUT that is a file, holds data (without ``--overwrite``), or holds ``protected``
    paths (the run directory, its checkpoints) or lies inside one of the checkpoints."""
    resolved = out.resolve()
    for path in protected:
        held = path.resolve()
        if resolved == held or held.is_relative_to(resolved) or (
                resolved.is_relative_to(held) and path.name.startswith("step-")):
            raise ExportError(f"OUT={str(out)!r} would hold or replace {path}: name a directory of its "
                              f"own for the export (e.g. {path.parent.parent / 'export'})")
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT={str(out)!r} is a file: name a new directory for the export")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"OUT={str(out)!r} exists and is not empty: name a new directory, or add "
                          f"--overwrite to replace it")


def remove_stale(out: Path) -> None:
    """Partial directories of OUT that a killed export left (its pid is gone)."""
    for stale in out.parent.glob(f".{out.name}{PARTIAL}*"):
        pid = stale.name.removeprefix(f".{out.name}{PARTIAL}").split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@contextmanager
def publishing(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yields the partial directory; OUT becomes it when the block completes, else it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}{PARTIAL}{os.getpid()}-"))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the export from the colleagues it is for
    try:
        yield partial
        _fsync_tree(partial)
        _replace(partial, out, overwrite)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


def _replace(partial: Path, out: Path, overwrite: bool) -> None:
    """``partial`` becomes ``out``; an older OUT (``--overwrite``) is removed only after."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:  # it filled while this export ran
            raise ExportError(f"OUT={str(out)!r} was filled while the export ran: name a new directory, "
                              f"or add --overwrite to replace it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    elif out.is_dir():
        out.rmdir()  # empty: the user made it for the export
    partial.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
