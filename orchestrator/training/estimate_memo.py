"""Memory estimates remembered across submissions (``memory.estimate_cache``).

The estimate runs one training step on fake tensors; ``FakeTensorMode`` imports all of
``torch._dynamo`` to do it, so a small model's estimate costs 1.5-2.5 s of the submitting
process, most of it imports. The same job submitted again (a resubmission after a fix elsewhere,
a rerun, another seed, a sweep's next launch) has the same step, so its estimate is read back
from a small JSON file instead: the estimate, or why the step could not be estimated.

The file's name is a hash of what the step's memory depends on, known before it runs:
``estimate.memo_key`` (the model, task, data and parallelism config, the memory options, the
optimizer's state, the dataset's fingerprint), torch's version, the interpreter, the installed
packages (their folders' modification times, which every ``pip install`` or upgrade changes), and
this format's version. The file lists the code the step ran: every module loaded from outside the
standard library and the installed packages when it ended (the user's model and task and what they
import, an editable Switchyard), by path, size and modification time. A file is read back only if
each of them is unchanged, so an edit of the model's code, or of a helper it imports while the step
runs, runs the step again. ``memory.estimate_cache=null`` turns remembering off.

Nothing here can fail a submission: an unreadable, malformed or unwritable file is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import site
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from durable import atomic
from orchestrator.launch import snapshot

FORMAT = 1  # bump when what a file holds, or how the estimate is computed, changes meaning
KEEP = 500  # files kept in the folder, newest first: each is a few kilobytes
PREFIX = "estimate-"  # every file this module writes: only such names are ever pruned
OURS = re.compile(rf"{PREFIX}[0-9a-f]{{32}}\.json")


def installed_folders() -> list[str]:
    """Where installed packages go: every ``pip install`` adds and removes folders here."""
    return [*site.getsitepackages(), site.getusersitepackages(),
            *(sysconfig.get_path(name) for name in ("purelib", "platlib"))]


def file_name(memo_key: str) -> str:
    """The memo's name: ``memo_key`` with torch, the interpreter and the installed packages."""
    packages = []
    for folder in sorted({os.path.realpath(path) for path in installed_folders()}):
        try:
            packages.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:
            continue
    key = repr((FORMAT, memo_key, torch.__version__, sys.executable, packages))
    return f"{PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def loaded_code() -> list[list[Any]]:
    """``[path, size, mtime_ns]`` of each loaded module's file that is the user's code, by
    ``snapshot.installed``'s rule: neither the standard library's nor an installed package's."""
    seen = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or snapshot.installed(path):
            continue
        try:
            info = os.stat(path)
        except OSError:
            continue
        seen.append([path, info.st_size, info.st_mtime_ns])
    return sorted(seen)


def unchanged(code: object) -> bool:
    """Every file of ``loaded_code()``'s list still has its size and modification time."""
    if not isinstance(code, list):
        return False
    for entry in code:
        try:
            path, size, mtime_ns = entry
            info = os.stat(path)
        except (OSError, TypeError, ValueError):
            return False
        if (info.st_size, info.st_mtime_ns) != (size, mtime_ns):
            return False
    return True


def recall(folder: Path, name: str) -> dict[str, Any] | None:
    """``{"estimate": {...}}`` or ``{"unavailable": "why"}`` remembered under ``name``; None if
    there is none, it cannot be read as one, or the code it ran has changed since."""
    try:
        found = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("format") != FORMAT or not unchanged(found.get("code")):
        return None
    if isinstance(found.get("estimate"), dict) or isinstance(found.get("unavailable"), str):
        return found
    return None


def remember(folder: Path, name: str, memo_key: str, found: dict[str, Any]) -> None:
    """Write ``found`` whole (or not at all) and keep the folder to its newest ``KEEP`` files of
    this module's names (``OURS``): whatever else the folder holds is never deleted."""
    try:
        atomic.write_json(folder / name, {"format": FORMAT, "written": time.time(), "memo_key": memo_key,
                                          "code": loaded_code(), **found}, durable=False)
        files = sorted((p for p in folder.glob(f"{PREFIX}*.json") if OURS.fullmatch(p.name)),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home or a full disk: the next submission estimates again
