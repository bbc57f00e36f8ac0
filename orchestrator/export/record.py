"""A run's exports, as ``switchyard show`` lists them: ``RUN/exports.jsonl`` has one line per
export (where it went), and each export's own ``export.json`` says what it is and how it was
verified. An export deleted or pruned since is not shown. Imports nothing heavy: ``show`` is quick.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from durable.atomic import atomic_write

EXPORT_FILE = "export.json"
RECORD_FILE = "exports.jsonl"  # in the run directory: every export of the run, one line each


def remember(run_dir: Path, record: dict[str, Any]) -> None:
    """One line in RUN/exports.jsonl (rewritten whole: a killed write leaves the old file)."""
    path = run_dir / RECORD_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    line = json.dumps({k: record[k] for k in ("path", "format", "step", "max_abs_diff", "created_at")})
    with atomic_write(path, durable=False) as f:
        f.write("\n".join([*lines, line]) + "\n")


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    """The run's exports that still exist, each its export.json, oldest first; an OUT exported to
    again (``--overwrite``) once, as it is now."""
    path = run_dir / RECORD_FILE
    found: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            where = Path(json.loads(line)["path"])
            found.pop(str(where), None)
            found[str(where)] = json.loads((where / EXPORT_FILE).read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue  # pruned or deleted since: not shown
    return list(found.values())


def show_lines(exports: list[dict[str, Any]]) -> list[str]:
    """One line per export: what, where, and how it was verified."""
    lines = []
    for r in exports:
        diff = r.get("max_abs_diff")
        checked = f"max |logit diff| {diff:.2g}" if isinstance(diff, float) else "weights compared"
        parameters = (r.get("verification") or {}).get("parameters")
        lines.append(f"export: step {r.get('step')} as {r.get('format')} ({r.get('class')}) -> "
                     f"{r.get('path')}; verified: {checked}, {parameters:,} parameters; checkpoint "
                     f"xxh3 {r.get('checkpoint_checksum')}")
    return lines
