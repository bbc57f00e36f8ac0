"""Which rank stopped answering: a heartbeat per rank, and the verdict read from them after a hang.

A collective that times out fails on the ranks that *waited*, not on the one that hung: gloo raises
on every waiting rank, NCCL's watchdog aborts them. Their errors name themselves, so a failure report
built from errors alone blames the wrong ranks. Each rank therefore runs a thread that rewrites
``RUN/heartbeat/rank-<R>.json`` every ``interval_s`` with a beat counter, the wall time, and where
the rank's main thread is (step and phase: two attribute writes per step, no I/O, no device read).

After a failure the submitting side reads the last beats (``verdict``):

- a rank whose last beat is several intervals older than the others', or whose beats once paused
  for several intervals, stopped answering: its whole process froze (SIGSTOP, swapped out, a
  driver call that never returns while holding the GIL) or its node went away. The pause counts
  too because SLURM sends SIGCONT before it terminates a step: a stopped rank wakes up and beats
  on (for as long as its stop handling takes) before it dies, so its last beat alone looks fresh.
  A rank that *left* its heartbeat (its last beat says ``ended``: its collective raised and it
  exited) is never judged by the age of that beat: the woken rank beating on after it is no sign
  that the ranks which gave up on it froze;
- otherwise, every rank kept beating until the job was stopped, and the ranks furthest behind in
  (step, phase) are the ones the others waited for (a data read or a loop of their own);
- otherwise the heartbeats cannot tell, and the report says so instead of guessing.

Wall times come from each node's clock: a skew under ``interval_s`` does not change the verdict
(cluster nodes run NTP; the gap that marks a frozen rank is the collective timeout, minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from durable import atomic

# Where a rank's main thread is, in the order a step goes through them.
PHASES = ("start", "data", "compute", "eval", "checkpoint", "done")
STALE_INTERVALS = 3.0  # a beat this many intervals older than the newest one: that rank froze
# A pause this many intervals long: that rank froze. Longer than STALE_INTERVALS because a busy node
# (more ranks than cores, a GIL-holding call) delays a beat by seconds, while a frozen rank's pause
# is the whole collective timeout, about ten intervals (interval_for).
PAUSE_INTERVALS = 5.0


def heartbeat_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "heartbeat"


def interval_for(collective_timeout_s: float) -> float:
    """A tenth of the collective timeout, within [0.5, 10] s: a frozen rank's last beat is then
    about ten intervals older than the waiting ranks' when their timeout fires."""
    return min(10.0, max(0.5, collective_timeout_s / 10))


@dataclass(frozen=True)
class Beat:
    rank: int
    node: str
    pid: int
    beat: int  # how many times this rank's thread has written
    time: float  # wall clock (time.time()) of this write
    step: int
    phase: str
    interval_s: float
    longest_pause_s: float = 0.0  # the longest time between two of this rank's beats
    ended: bool = False  # the rank left its heartbeat (finished, or raised and exited)

    @property
    def progress(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase) if self.phase in PHASES else 0

    def where(self) -> str:
        return f"step {self.step}, {self.phase}; pid {self.pid} on node {self.node}"


class Heartbeat:
    """This rank's beating thread; the trainer moves ``step`` and ``phase`` as it goes."""

    def __init__(self, run_dir: Path, rank: int, node: str, interval_s: float,
                 watch: Callable[[int, str], None] | None = None) -> None:
        """``watch(step, phase)``: called by the beating thread after each beat (the hang dumps'
        request: ``hang_dumps.Dumper.poll``)."""
        self.path = heartbeat_dir(run_dir) / f"rank-{rank}.json"
        self.watch = watch
        self.rank, self.node, self.interval_s = rank, node, interval_s
        self.step, self.phase = 0, "start"
        self._count = 0
        self._last = time.monotonic()
        self._longest_pause_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchyard-heartbeat", daemon=True)

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def beat(self, ended: bool = False) -> None:
        now = time.monotonic()
        self._count += 1
        self._longest_pause_s = max(self._longest_pause_s, now - self._last)
        self._last = now
        record = Beat(rank=self.rank, node=self.node, pid=os.getpid(), beat=self._count,
                      time=time.time(), step=self.step, phase=self.phase, interval_s=self.interval_s,
                      longest_pause_s=round(self._longest_pause_s, 3), ended=ended)
        with contextlib.suppress(OSError):  # a full or flaky disk must not kill the training
            atomic.write_json(self.path, asdict(record), durable=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()
            if self.watch is not None:
                with contextlib.suppress(Exception):  # a dump that fails must not stop the beats
                    self.watch(self.step, self.phase)

    def __enter__(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.beat(ended=True)  # where this rank ended, for a report on a failure after it


def read_beats(run_dir: Path) -> list[Beat]:
    found = []
    for path in sorted(heartbeat_dir(run_dir).glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(Beat(**json.loads(path.read_text())))
    return found


@dataclass(frozen=True)
class Verdict:
    ranks: list[int]  # the ranks the others waited for; [] when the heartbeats cannot tell
    why: dict[int, str]  # rank -> what its heartbeat shows
    summary: str  # one line for the failure report


def verdict(beats: Sequence[Beat], world_size: int) -> Verdict:
    """Who the others waited for, from each rank's last heartbeat (see the module docstring)."""
    if not beats:
        return Verdict([], {}, "cannot tell which rank hung: no rank left a heartbeat")
    newest = max(b.time for b in beats)
    interval = max(b.interval_s for b in beats)
    silent = sorted(set(range(world_size)) - {b.rank for b in beats})
    frozen = {b.rank: f"its last heartbeat was {newest - b.time:.0f} s before the others'"
              for b in beats if not b.ended and newest - b.time > STALE_INTERVALS * interval}
    frozen.update({b.rank: f"its heartbeat paused for {b.longest_pause_s:.0f} s"
                   for b in beats
                   if b.rank not in frozen and b.longest_pause_s > PAUSE_INTERVALS * interval})
    if frozen or silent:
        where = {b.rank: b.where() for b in beats}
        why = {r: f"stopped answering: {what} ({where[r]}); its process froze (stopped, swapped "
                  f"out, a call that never returned) or its node went away"
               for r, what in frozen.items()}
        why.update({r: "left no heartbeat: it never started training" for r in silent})
        ranks = sorted(why)
        return Verdict(ranks, why, f"rank{'s' if len(ranks) > 1 else ''} "
                                   f"{', '.join(map(str, ranks))} stopped answering; the other ranks "
                                   f"waited for {'them' if len(ranks) > 1 else 'it'} in a collective")
    slowest = min(b.progress for b in beats)
    behind = [b for b in beats if b.progress == slowest]
    if len(behind) < len(beats):
        ahead = max(beats, key=lambda b: b.progress)
        why = {b.rank: f"fell behind: still at {b.where()} while others had reached step "
                       f"{ahead.step}, {ahead.phase}" for b in behind}
        ranks = sorted(why)
        return Verdict(ranks, why, f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                                   f"fell behind; the other ranks waited for "
                                   f"{'them' if len(ranks) > 1 else 'it'} in a collective")
    return Verdict([], {}, f"cannot tell which rank hung: every rank kept beating until the job "
                           f"was stopped and all were at step {beats[0].step}, {beats[0].phase} "
                           f"(a collective the ranks entered in a different order, or a network "
                           f"fault between nodes)")
