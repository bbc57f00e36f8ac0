"""Checkpoints that survive being killed mid-write: temp file, fsync, rename; the last K kept.

Each ``step-N.pt`` has its xxh3 checksum beside it (``step-N.pt.xxh3``, published before the
checkpoint itself), taken while the bytes are written. Loading verifies it first: a checkpoint
whose bytes changed on disk (a bad sector, a partial copy, a stray write) is skipped with a
warning and the previous one is used, instead of resuming from garbage. A checkpoint without a
checksum file (written by a Switchyard before checksums) is loaded unverified, and says so.

A run writes and prunes only its own checkpoints: each records the run directory that wrote it
(``writer``), ``save`` refuses to replace one of the same step that another run wrote, and
``keep_last`` counts and deletes this run's alone. A checkpoint that records no writer (written
before writers were recorded) counts as the run's own, as a resume counts it. One that cannot be
read (damaged, or a file of the same name that is no checkpoint) is neither pruned nor replaced:
whose it is is unknown, so a save of its step first renames it to ``step-N.pt.unreadable``.

Loading always maps to the CPU first: ``torch.load`` of a checkpoint saved from ``cuda:0`` would
otherwise put every rank's copy on GPU 0 (the classic "GPU 0 fills up at DDP start").
"""

from __future__ import annotations

import errno
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import xxhash

from durable.atomic import atomic_write, write_text

CHECKSUM_SUFFIX = ".xxh3"
_READ_CHUNK = 8 << 20

# step-N.pt: one file (ddp, rank 0 writes it); step-N.dcp/: a directory of shards (fsdp, every rank
# writes its own; sharded_checkpoint)
_NAME = re.compile(r"^step-(\d{9})\.(pt|dcp)$")
TRAIN_STATE = "train_state.pt"  # inside a step-N.dcp/: everything but the tensors


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this run."""


# What to do about a save the file system refused, by errno (both formats: one wording).
_SAVE_FIXES = {
    errno.ENOSPC: "free space there, keep fewer with checkpoint.keep_last, or set checkpoint.dir to a "
                  "file system with room",
    errno.EDQUOT: "your quota there is used up: free some, or set checkpoint.dir to another file system",
    errno.EROFS: "that file system is read-only: set checkpoint.dir to a writable one",
    errno.EACCES: "you may not write there: set checkpoint.dir to a directory you can write",
}


def save_failed(path: Path, error: BaseException) -> CheckpointError | None:
    """One line for a save the file system refused (a full disk, a quota, a read-only mount):
    the checkpoint, the system's reason, the free space when it failed, the fix. None when the
    file system is not the cause (the caller re-raises ``error`` as is).

    The reason is an OSError found through the chain and through DCP's per-rank failures
    (``CheckpointException ranks:dict_keys([0, 1])`` named neither the path nor the cause), or
    torch's writer reporting a short write (``unexpected pos``): its OSError is lost once DCP has
    pickled the failure to the other ranks."""
    found = _io_cause(error)
    if found is None:
        return None
    reason, number = found
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:,.1f} MiB free there"
    except OSError:
        free = "the free space unknown"
    fix = _SAVE_FIXES.get(number or 0, "check checkpoint.dir")
    return CheckpointError(f"cannot save checkpoint {path}: {reason} ({free}); it was not published, "
                           f"and the checkpoints before it are kept ({fix})")


def _io_cause(error: BaseException) -> tuple[str, int | None] | None:
    """(reason, errno) of the first OSError under ``error``, else of a short write; else None."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    short: tuple[str, int | None] | None = None
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.strerror or str(e), e.errno
        if isinstance(e, RuntimeError) and short is None and (m := _SHORT_WRITE.search(str(e))):
            short = (f"a write came up short (torch's writer: {m.group(0)}), as on a full disk or "
                     f"quota", errno.ENOSPC)
        failures = getattr(e, "failures", None)  # DCP: rank -> (exception, traceback summary)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values()
                     if isinstance(f, tuple) and isinstance(f[0], BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return short


_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    state: dict[str, Any]
    skipped: tuple[str, ...]  # newer checkpoints that could not be read, with why
    verified: bool = True  # False: no checksum file (an older Switchyard wrote it)


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}.pt"


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


class _Hashing:
    """A binary file that hashes what is written through it: the checksum costs no second read."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.hash = f, xxhash.xxh3_64()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save(directory: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write atomically (its checksum first), then drop all but the newest ``keep_last`` of the
    run that wrote ``state`` (``writer``); a checkpoint of this step that another run wrote is
    refused, not replaced.

    Only rank 0 of the one run that holds this directory saves here (``run_lock``), so a temp file
    already present is what a save killed earlier left (``.step-N.pt.XXXX.tmp``, as large as a
    checkpoint): it is removed first, as the sharded format removes its partial directories."""
    final = path_for(directory, step)
    make_way(final, writer(state))
    remove_leftovers(directory)
    try:
        with atomic_write(final, binary=True) as f:
            hashing = _Hashing(f)
            torch.save(state, hashing)  # type: ignore[arg-type]  # torch needs write() only
            write_text(checksum_path(final), hashing.hash.hexdigest() + "\n")  # before the rename below
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's writer wraps a failed write
        failure = save_failed(final, e)
        if failure is None:
            raise
        raise failure from e
    remember_writer(final, writer(state))
    prune(directory, keep_last, writer(state))
    return final


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete the temp files of killed saves (checkpoints and their checksum files), nothing else."""
    removed = [p for p in directory.glob(".step-*.pt*.tmp") if _LEFTOVER.fullmatch(p.name)]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


# atomic_write's temp names: "." + the final name + "." + mkstemp's random part + ".tmp".
_LEFTOVER = re.compile(r"\.step-\d+\.pt(" + re.escape(CHECKSUM_SUFFIX) + r")?\.[A-Za-z0-9_]+\.tmp")


def file_checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path) -> bool:
    """True when the checksum matches, False when there is none; raises when it does not match."""
    try:
        expected = checksum_path(path).read_text().strip()
    except FileNotFoundError:
        return False
    actual = file_checksum(path)
    if actual != expected:
        raise CheckpointError(f"checksum mismatch (xxh3 {actual}, written as {expected}): the file "
                              f"changed after it was saved")
    return True


def listed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint of either kind, newest first; temp files are not checkpoints."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def writer(state: dict[str, Any]) -> str | None:
    """The run directory that wrote a checkpoint (``provenance.run_id``); None for one written
    before it was recorded."""
    return (state.get("provenance") or {}).get("run_dir")


def recorded_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train state (step, compat, provenance, ...) of either kind, without reading its
    tensors (``mmap``: a multi-GB checkpoint costs its pickled header). Raises when unreadable."""
    sharded = path.is_dir()
    where = path / TRAIN_STATE if sharded else path
    try:
        state = torch.load(where, map_location="cpu", weights_only=False, mmap=not sharded)
    except Exception as e:
        raise CheckpointError(f"cannot read {where}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{where} is not a Switchyard checkpoint")
    return state


# (path, inode, mtime) -> (readable, writer). A published checkpoint is never changed in place (a
# save replaces it by a rename: a new inode), so each is read once per process, not at every
# prune: the header of a 300 MB checkpoint of 1,200 tensors took 0.16 s to read (measured here).
_WHOSE: dict[tuple[str, int, int], tuple[bool, str | None]] = {}


def _key(path: Path) -> tuple[str, int, int] | None:
    try:
        found = (path / TRAIN_STATE if path.is_dir() else path).stat()
    except OSError:
        return None
    return str(path), found.st_ino, found.st_mtime_ns


def _whose(path: Path) -> tuple[bool, str | None]:
    """(readable, its writer)."""
    key = _key(path)
    if key is not None and key in _WHOSE:
        return _WHOSE[key]
    try:
        found = True, writer(recorded_state(path))
    except CheckpointError:
        found = False, None
    if key is not None:
        _WHOSE[key] = found
    return found


def remember_writer(path: Path, owner: str | None) -> None:
    """A checkpoint just published by ``owner``: its writer is known without reading it back."""
    if (key := _key(path)) is not None:
        _WHOSE[key] = (True, owner)


def is_own(path: Path, owner: str | None) -> bool:
    """Whether ``owner``'s run wrote ``path`` (one that records no writer counts as its own);
    False for one that cannot be read."""
    readable, found = _whose(path)
    return readable and found in (None, owner)


def make_way(final: Path, owner: str | None) -> None:
    """Before ``owner``'s run saves ``final``: refuse if another run wrote it; set it aside
    (``set_aside``) if it cannot be read. One this run wrote (a stop right after a resume saves the
    step it resumed at again) is replaced by the save."""
    if not final.exists():
        return
    readable, found = _whose(final)
    if not readable:
        set_aside(final)
    elif found not in (None, owner):
        raise CheckpointError(
            f"refusing to overwrite {final}: it was written by another run (hydra.run.dir={found!r}), "
            f"not by this one (hydra.run.dir={owner!r}); a run writes and prunes only its own "
            f"checkpoints. Give this run a checkpoint.dir of its own (leave checkpoint.dir unset for "
            f"RUN_DIR/checkpoints), or continue that run with hydra.run.dir={found!r}")


UNREADABLE_SUFFIX = ".unreadable"


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that cannot be read (and its checksum file) out of the way, kept for
    the user to look at or delete: ``step-N.pt.unreadable`` (``-2``, ``-3``, ... when taken). No
    longer a checkpoint's name, nor a temp file's: never listed, loaded or removed."""
    aside = path.with_name(path.name + UNREADABLE_SUFFIX)
    number = 1
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}-{number}")
    path.rename(aside)
    if checksum_path(path).exists():
        checksum_path(path).rename(checksum_path(aside))
    return aside


def prune(directory: Path, keep_last: int, owner: str | None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints of ``owner``'s run (``is_own``): another
    run's, and any that cannot be read, are neither counted nor deleted."""
    own = [path for _, path in listed(directory) if is_own(path, owner)]
    for path in own[keep_last:]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            continue
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)


def load_path(path: Path) -> Found:
    """One given checkpoint (rank 0 chose and verified it), on the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    return Found(path=path, step=int(state["step"]), state=state, skipped=())


def candidates(source: Path) -> list[Path]:
    """What a resume may load from ``source``, newest first: a directory's checkpoints, or the one
    checkpoint it names (``checkpoint.resume_from=.../step-N.pt``)."""
    if _NAME.match(source.name) and source.exists():
        return [source]
    return [path for _, path in listed(source)]


def load_latest(directory: Path, paths: list[Path] | None = None) -> Found | None:
    """The newest readable checkpoint of ``directory`` (or of ``paths``, newest first, when given),
    on the CPU; unreadable newer ones are reported, not fatal."""
    skipped = []
    for path in [p for _, p in listed(directory)] if paths is None else paths:
        if path.is_dir():  # a sharded checkpoint: the trainer refused the mismatch before
            continue
        try:
            verified = verify(path)
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # a checksum mismatch, truncated, or not a torch file at all
            skipped.append(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if not isinstance(state, dict) or "step" not in state:
            skipped.append(f"{path.name}: not a Switchyard checkpoint")
            continue
        return Found(path=path, step=int(state["step"]), state=state, skipped=tuple(skipped),
                     verified=verified)
    if skipped:
        raise CheckpointError(f"no readable checkpoint in {directory}: " + "; ".join(skipped))
    return None
