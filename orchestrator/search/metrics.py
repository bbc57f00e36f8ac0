"""A trial's objective as its ranks write it: every line of ``RUN/metrics.jsonl`` that has the
objective's key is one intermediate value (an eval window for ``eval_*``), the last one the
trial's value. Read whole at each look: the file is small (one line per log step), and a requeued
trial's resume rewrites it without the lines past its checkpoint (``run_log``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Window:
    step: int
    value: float  # NaN where the trainer wrote null (a non-finite metric)


def windows(run_dir: str | Path, key: str) -> list[Window]:
    """``(step, value)`` of every complete line that has ``key``, in the file's order."""
    try:
        text = (Path(run_dir) / METRICS_FILE).read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):  # the line being written
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and key in record and isinstance(record.get("step"), int):
            value = record[key]
            number = float(value) if isinstance(value, (int, float)) else math.nan
            found.append(Window(record["step"], number))
    return found
