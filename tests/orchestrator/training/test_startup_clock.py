"""A rank's start-up is timed from its process's start as the kernel recorded it (``startup``)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from orchestrator.training.startup import Clock, process_start_time

SAY_START = "from orchestrator.training.startup import process_start_time; print(repr(process_start_time()))"


def test_a_process_start_is_read_to_a_clock_tick_not_a_whole_second_early() -> None:
    """Before: psutil's create_time, whose boot time is whole seconds, put every start up to a
    second early (0.89 s on the project's machine), and a rank's "imports" read that much longer."""
    before = time.time()
    started = float(subprocess.run([sys.executable, "-c", SAY_START], capture_output=True, text=True,
                                   check=True).stdout)
    assert before - 0.02 <= started <= time.time()  # one tick (10 ms) of rounding, and a margin


def test_the_clock_starts_where_this_process_did() -> None:
    assert abs(Clock().process_start - process_start_time()) < 1e-3
    assert abs(process_start_time() - psutil.Process().create_time()) < 1.01  # the same instant, near enough
