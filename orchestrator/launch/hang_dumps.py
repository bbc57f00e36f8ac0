"""Where each rank was when a collective hung: its Python stacks and its last collectives.

The heartbeats (``heartbeat``) tell which rank stopped answering. A rank that is alive but busy
elsewhere (stuck in its data loader, a loop of its own, a collective the others never entered)
keeps beating, and then the heartbeats can only say "cannot tell". What tells is where every rank
was: its stacks, and which collective it entered last, by sequence number.

- **The collective trace** is PyTorch's flight recorder, a ring buffer of each process group's
  last collectives (sequence number, op, sizes, state), which PyTorch keeps under gloo as under
  NCCL once ``TORCH_FR_BUFFER_SIZE`` (``TORCH_NCCL_TRACE_BUFFER_SIZE`` for NCCL) is set before the
  process group starts (:func:`recorder_environment`). Under NCCL its watchdog also dumps the
  buffer itself when a collective times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``), into
  ``RUN/hang/nccl_trace_rank_<R>``, before it aborts the rank.
- **A dump is asked for** by a rank whose collective timed out: it writes ``RUN/hang/request.json``,
  dumps itself, and waits a few heartbeat intervals for the others before it fails. Every other
  rank's heartbeat thread looks for the request (or an NCCL dump) at each beat (one ``stat``), and
  dumps its own stacks (every thread, the main one's innermost frame last) and recorder entries
  into ``RUN/hang/rank-<R>.json``. A rank whose process froze cannot dump; the heartbeats name it.
- **The report** (:func:`report`) reads the dumps: the ranks whose last collective is behind the
  others' are the ones the others waited for (or, at one sequence number, the ranks that entered a
  different op), each with its innermost frames. The failure report, ``switchyard show`` and
  ``summary.json`` carry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from durable import atomic

HANG_DIR = "hang"  # RUN/hang/
REQUEST = "request.json"
NCCL_PREFIX = "nccl_trace_rank_"  # PyTorch's own dump on an NCCL timeout, one file per rank
RECORDER_ENTRIES = 2000  # the flight recorder's ring: enough for a few steps of a large model's buckets
KEPT_COLLECTIVES = 8  # the last entries of each process group kept in a rank's dump
INNERMOST_FRAMES = 3  # frames of the main thread's stack shown in a report line


# A collective that waited too long: gloo raises on the waiting ranks, NCCL's watchdog aborts them.
_COLLECTIVE_TIMEOUT = re.compile(r"Application timeout caused pair closure|Timed out waiting|"
                                 r"Watchdog caught collective operation timeout|"
                                 r"ProcessGroup\w* .*timed out|Socket Timeout")


def is_collective_timeout(error: str) -> bool:
    """Whether a rank's error is a collective that waited too long (gloo's or NCCL's words)."""
    return _COLLECTIVE_TIMEOUT.search(error) is not None


def hang_dir(run_dir: Path) -> Path:
    return Path(run_dir) / HANG_DIR


def recorder_environment(run_dir: Path) -> dict[str, str]:
    """The flight recorder's settings, for a rank to set before its process group starts; a value
    the user set is theirs."""
    import torch

    # TORCH_FR_BUFFER_SIZE names the one recorder since torch 2.8, and the old name warns there.
    older = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) < (2, 8)
    size = "TORCH_NCCL_TRACE_BUFFER_SIZE" if older else "TORCH_FR_BUFFER_SIZE"
    wanted = {size: str(RECORDER_ENTRIES),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(hang_dir(run_dir) / NCCL_PREFIX)}
    return {k: v for k, v in wanted.items() if k not in os.environ}


@dataclass(frozen=True)
class Collective:
    """One entry of the flight recorder."""

    group: str  # the process group's name
    seq: int  # its collective sequence number in that group
    op: str  # "gloo:allreduce", "nccl:all_reduce", ...
    state: str

    def label(self) -> str:
        return f"{self.op.partition(':')[2] or self.op} #{self.seq}"


@dataclass(frozen=True)
class RankDump:
    rank: int
    node: str
    pid: int
    step: int
    phase: str
    reason: str  # why it dumped: its own timeout, or another rank's request
    stacks: dict[str, list[str]]  # thread name -> its frames, outermost first, one line each
    collectives: list[Collective] = field(default_factory=list)  # oldest first
    error: str | None = None

    def last(self) -> Collective | None:
        return self.collectives[-1] if self.collectives else None

    def innermost(self, frames: int = INNERMOST_FRAMES) -> list[str]:
        main = self.stacks.get("MainThread") or next(iter(self.stacks.values()), [])
        return main[-frames:]


def recorded_collectives() -> list[Collective]:
    """This process's flight-recorder entries, the last few of each process group; [] where this
    torch has no recorder or nothing was recorded."""
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    entries: list[dict[str, Any]] = []
    # NCCL's process groups have a recorder of their own (CUDA builds); gloo's use the generic one.
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        with contextlib.suppress(Exception):  # not in this build, or it refused: the stacks still tell
            entries += json.loads(getattr(c10d, name)(True, True)).get("entries") or []
    by_group: dict[str, list[Collective]] = {}
    for e in entries:
        if e.get("is_p2p"):
            continue
        group = str((e.get("process_group") or ["?"])[0])
        if any(c.seq == e.get("collective_seq_id") for c in by_group.get(group, [])):
            continue  # the same entry in both recorders
        by_group.setdefault(group, []).append(Collective(group, int(e.get("collective_seq_id", 0)),
                                                         str(e.get("profiling_name", "?")),
                                                         str(e.get("state", "?"))))
    return [c for kept in by_group.values() for c in sorted(kept, key=lambda c: c.seq)[-KEPT_COLLECTIVES:]]


def current_stacks() -> dict[str, list[str]]:
    """Every thread's stack, outermost frame first, one line per frame (file, line, function)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(ident, f"thread {ident}"): _frames(traceback.extract_stack(frame))
            for ident, frame in sys._current_frames().items()}


def error_stack(error: BaseException) -> list[str]:
    return _frames(traceback.extract_tb(error.__traceback__))


def _frames(summary: traceback.StackSummary) -> list[str]:
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in summary]


def _short(filename: str) -> str:
    """An installed package's file from its package on (``torch/autograd/graph.py``); the rest whole."""
    _, marker, inside = filename.rpartition("-packages/")
    return inside if marker else filename


class Dumper:
    """This rank's part: answer a request from its heartbeat thread (``poll``), or ask one when its
    own collective timed out (``on_timeout``)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, node: str) -> None:
        self.dir = hang_dir(run_dir)
        self.rank, self.world_size, self.node = rank, world_size, node
        self.dumped = False
        self._lock = threading.Lock()

    def poll(self, step: int, phase: str) -> None:
        """At each beat: one stat for a request, one listing for NCCL's own dump when the folder exists."""
        if self.dumped or not self.dir.is_dir():
            return
        request = self.dir / REQUEST
        if request.exists():
            asker = _read_json(request).get("rank", "?")
            self.dump(step, phase, f"rank {asker}'s collective timed out")
        elif any(p.name.startswith(NCCL_PREFIX) for p in self.dir.iterdir()):
            self.dump(step, phase, "NCCL's watchdog dumped its trace")

    def dump(self, step: int, phase: str, reason: str, error: BaseException | None = None) -> None:
        with self._lock:
            if self.dumped:
                return
            self.dumped = True
        stacks = current_stacks()
        if error is not None:  # where the rank was when it raised, not the handler it is in now
            stacks["MainThread"] = error_stack(error)
        found = RankDump(self.rank, self.node, os.getpid(), step, phase, reason, stacks,
                         recorded_collectives(), f"{type(error).__name__}: {error}" if error else None)
        with contextlib.suppress(OSError):  # a full disk must not hide the error being reported
            atomic.write_json(self.dir / f"rank-{self.rank}.json", asdict(found), durable=False)

    def on_timeout(self, step: int, phase: str, error: BaseException, wait_s: float) -> None:
        """Our collective timed out: ask every rank for its dump, give ours, and wait up to
        ``wait_s`` for the others' before the failure goes on."""
        with contextlib.suppress(OSError):
            self.dir.mkdir(parents=True, exist_ok=True)
            if not (self.dir / REQUEST).exists():
                atomic.write_json(self.dir / REQUEST, {"rank": self.rank, "time": time.time()}, durable=False)
        self.dump(step, phase, "its collective timed out", error)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(list(self.dir.glob("rank-*.json"))) < self.world_size:
            time.sleep(0.2)


    def on_peer_lost(self, step: int, phase: str, error: BaseException, wait_s: float) -> None:
        """Our peer's connection closed under us. gloo closes a pair when its collective times out,
        so the rank that timed out may be asking for dumps this very moment: wait up to ``wait_s``
        for its request, and if it comes, give ours as ``on_timeout`` would (a crash asks nothing,
        and costs this wait)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if (self.dir / REQUEST).exists():
                self.on_timeout(step, phase, error, wait_s)
                return
            time.sleep(0.2)


def _read_json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(path.read_text())
        if isinstance(found, dict):
            return found
    return {}


def clear(run_dir: Path) -> None:
    """Rank 0, before the rendezvous (so before any rank can ask or dump): a previous attempt's
    request and dumps would make this one's ranks dump at once, and mix into its report."""
    with contextlib.suppress(OSError):
        shutil.rmtree(hang_dir(run_dir))


def asked(run_dir: Path) -> bool:
    """Whether a rank of this attempt asked for dumps: one of its collectives timed out."""
    return (hang_dir(run_dir) / REQUEST).exists()


def read_dumps(run_dir: Path) -> list[RankDump]:
    found = []
    for path in sorted(hang_dir(run_dir).glob("rank-*.json")):
        raw = _read_json(path)
        with contextlib.suppress(TypeError, ValueError):
            raw["collectives"] = [Collective(**c) for c in raw.get("collectives") or []]
            found.append(RankDump(**raw))
    return sorted(found, key=lambda d: d.rank)


@dataclass(frozen=True)
class HangReport:
    ranks: list[int]  # the ranks the others waited for, by their collectives; [] when they agree
    summary: str  # one line
    lines: list[str]  # one per rank that dumped: where it was

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def report(dumps: list[RankDump], world_size: int) -> HangReport | None:
    """Who the others waited for, from the ranks' last collectives; None without a dump."""
    if not dumps:
        return None
    lines = [_where(d) for d in dumps]
    silent = sorted(set(range(world_size)) - {d.rank for d in dumps})
    behind, summary = _behind(dumps)
    if silent:
        summary += (f"{'; ' if summary else ''}rank{'s' if len(silent) > 1 else ''} "
                    f"{_ranks(silent)} left no dump (a frozen process cannot)")
    return HangReport(behind, summary or "every rank that dumped was at the same collective", lines)


def _behind(dumps: list[RankDump]) -> tuple[list[int], str]:
    known = {d.rank: d for d in dumps if d.last() is not None}
    if len(known) < 2:
        return [], ""
    lasts = {r: d.last() for r, d in known.items()}
    newest = max(c.seq for c in lasts.values() if c is not None)
    late = sorted(r for r, c in lasts.items() if c is not None and c.seq < newest)
    if late:
        ahead = sorted(r for r in known if r not in late)
        return late, (f"{_at(known, late)}; {_who(ahead)} entered {_labels(lasts, ahead)}; "
                      f"{_stack_of(known, late)}")
    ops = Counter(c.op for c in lasts.values() if c is not None)
    if len(ops) > 1:  # one sequence number, different ops: a collective skipped or reordered
        common = ops.most_common(1)[0][0]
        odd = sorted(r for r, c in lasts.items() if c is not None and c.op != common)
        others = sorted(r for r in known if r not in odd)
        return odd, (f"{_at(known, odd)} where {_who(others)} entered {_labels(lasts, others)} (a "
                     f"collective skipped or called in another order); {_stack_of(known, odd)}")
    return [], ""


def _at(known: dict[int, RankDump], ranks: list[int]) -> str:
    """``rank 3 (n2) last entered all_reduce #1204 (step 301, compute)``."""
    return "; ".join(f"rank {r} ({known[r].node}) last entered {_labels({r: known[r].last()}, [r])} "
                     f"(step {known[r].step}, {known[r].phase})" for r in ranks)


def _stack_of(known: dict[int, RankDump], ranks: list[int]) -> str:
    return "; ".join(f"rank {r}'s stack: {' <- '.join(reversed(known[r].innermost())) or 'none'}"
                     for r in ranks)


def _labels(known: dict[int, Collective | None], ranks: list[int]) -> str:
    return ", ".join(dict.fromkeys(c.label() for r in ranks if (c := known[r]) is not None))


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _where(d: RankDump) -> str:
    last = d.last()
    entered = f"last entered {last.label()}" if last else "no collective recorded"
    frames = " <- ".join(reversed(d.innermost())) or "no stack"
    return f"rank {d.rank} ({d.node}, pid {d.pid}): step {d.step}, {d.phase}; {entered}; stack: {frames}"


REPORT = "report.json"  # RUN/hang/report.json: what the failure report said, for switchyard show
SUMMARY = "summary.json"


def record(run_dir: Path, verdict: str, where: HangReport) -> None:
    """The submitting side's report, kept beside the dumps and in the run's ``summary.json``
    (merged into what rank 0 left there, if anything)."""
    found = {"verdict": verdict, **where.as_dict()}
    with contextlib.suppress(OSError):
        atomic.write_json(hang_dir(run_dir) / REPORT, found, indent=1)
        summary = _read_json(Path(run_dir) / SUMMARY)
        atomic.write_json(Path(run_dir) / SUMMARY, {**summary, "hang": found}, indent=2)


def recorded(run_dir: Path) -> dict[str, Any] | None:
    """The report ``record`` kept; None when the run had no hang."""
    return _read_json(hang_dir(run_dir) / REPORT) or None
