"""Slow ranks, named before they become hangs: how late each rank enters the gradient reduction.

DDP's all-reduce evens out the ranks' step times (the fast ranks wait inside it for the slow one),
so a slow node cannot be seen in per-rank step times. It can be seen in *when* each rank starts its
step's compute, after its data: the moment it heads for the reduction. Each rank notes that wall
time once a step (``enter``: one ``time.time()``, no device read); at log steps, which already
sync with the host, the notes ride the metrics window's one CPU collective (each rank's in its own
row of a table reduced by MAX: gloo beside NCCL, no collective of their own), and each step's
lateness is a rank's time minus the earliest rank's.

A rank whose median lateness over a logging window is more than ``fraction`` of the step, in
``windows`` windows in a row, is flagged: rank 0 says so in its log (the line ``bad_nodes`` reads,
so ``resubmit --failed`` leaves that node out), keeps it in ``RUN/stragglers.json`` and in the
summary (``stragglers``, with every rank's median lateness in ``lateness_per_rank_s``).
Cluster nodes keep their clocks within milliseconds (NTP); the lateness that matters is a sizeable
share of a step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from durable import atomic
from orchestrator.launch.bad_nodes import SLOW_LINE_PREFIX, STRAGGLERS_FILE
from orchestrator.training import runtime
from orchestrator.training.runtime import Runtime

MIN_LATE_S = 0.005  # below this, clock skew and scheduling noise


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    median_late_s: float  # over the windows that flagged it
    share_of_step: float  # median_late_s / the median step time
    windows: int

    def line(self) -> str:
        return (f"{SLOW_LINE_PREFIX} {self.rank} on node {self.node}: it enters the gradient reduction "
                f"{self.median_late_s:.3f} s after the earliest rank ({self.share_of_step:.0%} of a "
                f"step, {self.windows} logging windows in a row): its data path or its node is slow")


class Lateness:
    """This rank's notes, and every rank's verdict at log steps (a collective: every rank calls
    ``close``)."""

    def __init__(self, rt: Runtime, run_dir: Path, fraction: float, windows: int) -> None:
        self.rt, self.run_dir, self.fraction, self.windows = rt, Path(run_dir), fraction, windows
        self.entered: list[float] = []
        self.nodes: list[str] | None = None
        self.streak = [0] * rt.env.world_size
        self.late_in_streak: list[list[float]] = [[] for _ in range(rt.env.world_size)]
        self.medians: list[list[float]] = [[] for _ in range(rt.env.world_size)]
        self.flagged: dict[int, Straggler] = {}

    def enter(self) -> None:
        self.entered.append(time.time())

    def payload(self) -> torch.Tensor | None:
        """This rank's notes of the window in its own row of a [world, steps] int64 table of
        microseconds, zeros elsewhere: reduced by MAX over ranks (the metrics window's CPU
        collective) it becomes every rank's notes. None when nothing is measured."""
        if self.fraction <= 0 or self.rt.env.world_size < 2:
            self.entered.clear()
            return None
        table = torch.zeros(self.rt.env.world_size, len(self.entered), dtype=torch.int64)
        table[self.rt.env.rank] = torch.tensor([round(t * 1e6) for t in self.entered], dtype=torch.int64)
        self.entered.clear()
        return table.flatten()

    def take(self, reduced: torch.Tensor | None) -> None:
        """Every rank's notes of the window (``payload`` after the reduction): flags and unflags."""
        if reduced is None or reduced.numel() < 2 * self.rt.env.world_size:
            return
        if self.nodes is None:
            self.nodes = [str(n) for n in runtime.gather(self.rt, self.rt.env.hostname)]
        matrix = reduced.view(self.rt.env.world_size, -1).to(torch.float64) / 1e6  # [world, steps] s
        earliest = matrix.min(dim=0).values  # [steps]
        step_s = float(earliest.diff().median())
        late = (matrix - earliest).median(dim=1).values.tolist()  # [world]
        for rank, seconds in enumerate(late):
            self.medians[rank].append(seconds)
            self.note(rank, seconds, step_s)

    def note(self, rank: int, late_s: float, step_s: float) -> None:
        if late_s > max(MIN_LATE_S, self.fraction * step_s):
            self.streak[rank] += 1
            self.late_in_streak[rank].append(late_s)
        else:
            self.streak[rank], self.late_in_streak[rank] = 0, []
            return
        if self.streak[rank] < self.windows or rank in self.flagged:
            return
        median = statistics.median(self.late_in_streak[rank])
        found = Straggler(rank, (self.nodes or ["?"] * (rank + 1))[rank], round(median, 4),
                          round(median / step_s, 3) if step_s > 0 else 0.0, self.streak[rank])
        self.flagged[rank] = found
        if self.rt.is_main:
            print(found.line(), flush=True)
            atomic.write_json(self.run_dir / STRAGGLERS_FILE, [asdict(s) for s in self.flagged.values()],
                              indent=1, durable=False)

    def as_summary(self) -> dict[str, Any]:
        return {"stragglers": [asdict(s) for s in self.flagged.values()],
                "lateness_per_rank_s": [round(statistics.median(m), 4) if m else None for m in self.medians]}
