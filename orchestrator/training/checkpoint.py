"""Checkpoints that survive being killed mid-write: temp file, fsync, rename; the last K kept.

Loading always maps to the CPU first: ``torch.load`` of a checkpoint saved from ``cuda:0`` would
otherwise put every rank's copy on GPU 0 (the classic "GPU 0 fills up at DDP start").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrator.atomic import atomic_write

_NAME = re.compile(r"^step-(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this run."""


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    state: dict[str, Any]
    skipped: tuple[str, ...]  # newer checkpoints that could not be read, with why


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}.pt"


def save(directory: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write atomically, then drop all but the newest ``keep_last``."""
    final = path_for(directory, step)
    with atomic_write(final, binary=True) as f:
        torch.save(state, f)
    prune(directory, keep_last)
    return final


def listed(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint, newest first; temp files are not checkpoints."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def prune(directory: Path, keep_last: int) -> None:
    for _, path in listed(directory)[keep_last:]:
        path.unlink(missing_ok=True)


def load_path(path: Path) -> Found:
    """One given checkpoint (rank 0 chose it), on the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    return Found(path=path, step=int(state["step"]), state=state, skipped=())


def load_latest(directory: Path) -> Found | None:
    """The newest readable checkpoint (on the CPU); unreadable newer ones are reported, not fatal."""
    skipped = []
    for step, path in listed(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated, corrupted, or not a torch file at all
            skipped.append(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if not isinstance(state, dict) or "step" not in state:
            skipped.append(f"{path.name}: not a Switchyard checkpoint")
            continue
        return Found(path=path, step=step, state=state, skipped=tuple(skipped))
    if skipped:
        raise CheckpointError(f"no readable checkpoint in {directory}: " + "; ".join(skipped))
    return None
