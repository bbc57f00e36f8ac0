"""What the submitting command shows while it follows a job: the queue state while the job pends,
then rank 0's progress (steps/total, samples/s, loss, ETA).

Rank 0's progress bar goes to its log file (``RUN/submitit/JOB_0_log.out``), so the terminal showed
nothing until the job ended. Nothing new is sent for this: the follower reads, once a second, what
the ranks write already, rank 0's heartbeat (``RUN/heartbeat/rank-0.json``: its step, every beat)
and the tail of ``RUN/metrics.jsonl`` (loss and samples/s, every ``log_every_steps``), a few KB.

On a terminal the line is redrawn in place on stderr; elsewhere (a pipe, a CI log) a line is
written when the job's state or first loss is known and then at most every ``LINE_EVERY_S``, never
a carriage return. stdout keeps what scripts parse (``run_dir: PATH`` first, the summary last).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from orchestrator.launch.heartbeat import heartbeat_dir
from orchestrator.terminal import one_line

POLL_S = 1.0  # how often the follower reads rank 0's files
LINE_EVERY_S = 30.0  # not a terminal: at most one line this often
METRICS_NAME = "metrics.jsonl"  # orchestrator.training.run_log.JSONL_NAME (not imported: torch-free)
TAIL_BYTES = 8192  # the end of metrics.jsonl read for its last training line


@dataclass(frozen=True)
class Seen:
    """Rank 0's progress as its files tell it; None where they do not (yet)."""

    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None


def read(run_dir: Path) -> Seen:
    """The furthest step of rank 0's heartbeat and metrics, and its last logged loss and rate."""
    steps: list[int] = []
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        steps.append(int(json.loads((heartbeat_dir(run_dir) / "rank-0.json").read_text())["step"]))
    last = last_training_line(run_dir / METRICS_NAME)
    loss = rate = None
    if last is not None:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            steps.append(int(last["step"]))
            loss = float(last["train_loss"]) if last.get("train_loss") is not None else None
            rate = float(last["samples_per_s"]) if last.get("samples_per_s") is not None else None
    return Seen(max(steps) if steps else None, loss, rate)


def last_training_line(path: Path) -> dict[str, Any] | None:
    """The last whole line of ``metrics.jsonl`` that holds a training loss (eval lines do not)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "train_loss" in record and "step" in record:
                return record
    return None


def duration(seconds: float) -> str:
    """``45 s``, ``3 min``, ``2 h 05 min``."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def describe(seen: Seen, total_steps: int | None, eta_s: float | None) -> str:
    """``rank 0: step 120/3000 (4%), 1,234 samples/s, loss 0.4321, ETA 2 min``."""
    if total_steps:
        parts = [f"step {seen.step}/{total_steps} ({100 * (seen.step or 0) // total_steps}%)"]
    else:
        parts = [f"step {seen.step}"]
    if seen.samples_per_s is not None:
        parts.append(f"{seen.samples_per_s:,.0f} samples/s")
    if seen.loss is not None:
        parts.append(f"loss {seen.loss:.4f}")
    if eta_s is not None:
        parts.append(f"ETA {duration(eta_s)}")
    return "rank 0: " + ", ".join(parts)


class Display:
    """One status line on ``stream``: redrawn in place on a terminal, else a line now and then."""

    def __init__(self, stream: TextIO | None = None, line_every_s: float = LINE_EVERY_S) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.line_every_s = line_every_s
        self.shown = ""  # on a terminal: what the line holds now
        self.last_line_at = -float("inf")  # elsewhere: when the last line was written
        self.last_kind = ""  # elsewhere: a new kind of line (pending, then running) is written at once
        self.lock = threading.Lock()

    def show(self, text: str, kind: str = "progress") -> None:
        text = one_line(text)
        with self.lock:
            if self.tty:
                width = shutil.get_terminal_size((100, 24)).columns - 1
                self.stream.write("\r" + text[:width] + "\x1b[K")
                self.shown = text
            else:
                now = time.monotonic()
                if kind == self.last_kind and now - self.last_line_at < self.line_every_s:
                    return
                self.stream.write(text + "\n")
                self.last_line_at, self.last_kind = now, kind
            self.stream.flush()

    def pending(self, job_id: str, state: str, reason: str | None, waited_s: float) -> None:
        """``job 123: PENDING (Priority), waited 3 min``: a SLURM job in the queue."""
        said = f" ({reason})" if reason and reason != "None" else ""
        # Off a terminal, a new reason is a new line at once (squeue says "None" just after sbatch).
        self.show(f"job {job_id}: {state}{said}, waited {duration(waited_s)}", kind=f"{state}{said}")

    def clear(self) -> None:
        """Leave the terminal's line empty, for what the command prints next."""
        with self.lock:
            if self.tty and self.shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self.shown = ""


class Follower:
    """Reads rank 0's files every ``poll_s`` on a thread and shows its progress, with an ETA from
    the steps seen since the follower started (a resumed run's earlier steps do not count)."""

    def __init__(self, run_dir: Path, total_steps: int | None, display: Display,
                 poll_s: float = POLL_S) -> None:
        self.run_dir, self.total_steps, self.display, self.poll_s = run_dir, total_steps, display, poll_s
        self.first: tuple[float, int] | None = None  # (monotonic time, step) of the first step seen
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="switchyard-progress", daemon=True)

    def poll(self) -> None:
        seen = read(self.run_dir)
        if seen.step is None:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, seen.step)
        # Off a terminal, the first line with a loss comes at once, not LINE_EVERY_S after the first
        # beat's "step 0": a new kind of line is written when it first appears.
        kind = "progress" if seen.loss is not None else "started"
        self.display.show(describe(seen, self.total_steps, self.eta_s(seen.step, now)), kind)

    def eta_s(self, step: int, now: float) -> float | None:
        if self.first is None or not self.total_steps or step <= self.first[1]:
            return None
        per_step = (now - self.first[0]) / (step - self.first[1])
        return per_step * max(self.total_steps - step, 0)

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            with contextlib.suppress(Exception):  # showing progress never breaks the following
                self.poll()


@contextlib.contextmanager
def following(run_dir: Path, total_steps: int | None, display: Display) -> Iterator[None]:
    """Rank 0's progress on ``display`` while the block waits for the job."""
    follower = Follower(run_dir, total_steps, display)
    follower.thread.start()
    try:
        yield
    finally:
        follower.stopped.set()
        follower.thread.join()
        display.clear()
