"""Where a rank's seconds go before its first step and after its last one.

A short job on a cluster spends most of its life outside the training loop: the interpreter and
its imports, the rendezvous, preflight, opening the dataset, building and settling the model,
finding and loading a checkpoint, the first batch. So does every requeue, and every point of a
sweep of short jobs. ``Clock`` marks each phase on a rank's wall clock, from the process's own
start (the kernel's record of it, so the interpreter's start-up and the imports are counted) to
the result written; rank 0's phases go into ``summary.json`` as ``startup_s`` and ``ending_s``,
and the log gets one line.

The marks are host clock reads at phase boundaries, a handful per run; the loop asks for the
first step's mark at every step, which after the first is one dict lookup (no device read).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

# The phases, in order; each mark ends the phase of its name (the first starts at the process's).
BEFORE_FIRST_STEP = ("imports", "preflight", "rendezvous", "data", "model", "compile", "resume", "first_step")
AFTER_LAST_STEP = ("final_checkpoint", "result")


def process_start_time() -> float:
    """The wall time this process started, to a clock tick (10 ms): the kernel records a start in
    ticks since boot, so its age is the boot clock's reading less that. psutil's ``create_time``
    adds the boot time that ``/proc/stat`` gives in whole seconds instead, which puts every start
    up to a second early (0.89 s on the project's machine): a rank's "imports" read that much too
    long, a resume's time to its first step too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # no procfs: psutil's reading, whole-second boot time
        return psutil.Process().create_time()
    return time.time() - age


class Clock:
    def __init__(self) -> None:
        self.process_start = process_start_time()  # the kernel's record: the interpreter's start counts
        self.marks: dict[str, float] = {}  # phase -> wall time it ended

    def mark(self, phase: str) -> bool:
        """True where this call ended the phase: a phase ends once; a resumed loop does not move it."""
        if phase in self.marks:
            return False
        self.marks[phase] = time.time()
        return True

    def startup_s(self) -> dict[str, float]:
        """Seconds per phase from the process's start to the end of its first step, and the total."""
        return self._phases(BEFORE_FIRST_STEP, self.process_start, "to_first_step")

    def ending_s(self) -> dict[str, float]:
        """Seconds per phase from the end of the last step to the result."""
        return self._phases(AFTER_LAST_STEP, self.marks.get("last_step"), "after_last_step")

    def _phases(self, phases: tuple[str, ...], since: float | None, total: str) -> dict[str, float]:
        if since is None:
            return {}
        out, previous = {}, since
        for phase in phases:
            if phase in self.marks:
                out[phase] = round(self.marks[phase] - previous, 3)
                previous = self.marks[phase]
        out[total] = round(previous - since, 3)
        return out


def describe(startup: dict[str, float]) -> str:
    """``start-up: 3.1 s to the first step (imports 1.6, rendezvous 0.4, ...)``."""
    parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in startup.items() if name != "to_first_step")
    return f"start-up: {startup.get('to_first_step', 0.0):.2f} s to the first step ({parts})"
