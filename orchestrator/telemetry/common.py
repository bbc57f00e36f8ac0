"""Shared by every telemetry module: the record type, byte units, errors and the formats of messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Record = dict[str, Any]

GIB = 1 << 30
MIB = 1 << 20


class TelemetryError(RuntimeError):
    """Telemetry files are missing or unusable (plotting a run that recorded nothing, ...)."""


class PreflightError(TelemetryError):
    """The GPUs this node shows do not match what the job asked for; training would waste the allocation."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def rank_list(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    if not ordered:
        return "no rank"
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))
