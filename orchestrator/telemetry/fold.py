"""Each node's samples folded as they are taken, so that nothing a command reads grows with how long
the job ran.

The sampler keeps, beside its raw ``<node>.jsonl``:

- ``<node>.fold.json``: the :class:`Digest` of every sample in the raw file (peaks, sums, counts)
  and ``raw_bytes``, how much of the raw file it covers, and the node's memory section as
  ``summarize`` gives it from them (``kept``, with what it was computed from): rewritten atomically
  when due and at the end (2-6 KB on an 8-GPU node);
- ``<node>.series.json``: memory over time downsampled to at most ``MAX_POINTS`` points per attempt
  boundary (each point the peak of the samples it stands for), for ``switchyard plot``; rewritten
  at most every ``SERIES_EVERY_S`` and when the sampler stops.

A reader (``switchyard status``, ``show``, ``plot``) reads those. A job of one node whose fold
covers its raw file is summarised from the kept memory section alone: one file per job, so the
first ``status`` after 10,000 jobs were killed reads them all in about a second.

What the raw file gained after the fold (a sampler killed between its two writes, or a series not
yet rewritten) is read from the raw file's end, at most ``TAIL_BYTES`` of it; a node whose sampler
left no fold (killed before its first sample ended, or samples written by an older Switchyard) is
summarised from its last ``TAIL_BYTES`` only, and the summary's notes say so. ``switchyard plot
--raw`` still reads every sample.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from durable import atomic
from orchestrator.telemetry.common import MIB, Record
from orchestrator.telemetry.files import telemetry_dir
from orchestrator.telemetry.stats import Digest

VERSION = 1
MAX_POINTS = 1024  # per node: a day at 5 s is 17,280 samples, shown as 540..1024 points of 32 samples
SERIES_EVERY_S = 60.0  # the series file is rewritten at most this often (and at the end)
TAIL_BYTES = 4 * MIB  # the most of a raw file a reader reads: 2,000 to 16,000 samples


def fold_file(raw: Path) -> Path:
    return raw.with_name(raw.name.removesuffix(".jsonl") + ".fold.json")


def series_file(raw: Path) -> Path:
    return raw.with_name(raw.name.removesuffix(".jsonl") + ".series.json")


def raw_files(run_dir: Path, listing: Collection[str] | None = None) -> list[Path]:
    """Each node's raw samples (os.scandir: status calls this for thousands of jobs); ``listing``:
    the names in the telemetry directory, when the caller has listed it already."""
    directory = telemetry_dir(run_dir)
    try:
        names = sorted(n for n in (os.listdir(directory) if listing is None else listing)
                       if n.endswith(".jsonl"))
    except FileNotFoundError:
        return []
    return [directory / name for name in names]


# -- the downsampled series -----------------------------------------------------------------------

def _slim(record: Record) -> Record:
    """What the plot draws of a sample: memory per GPU (or per rank), its time, attempt and end."""
    point: Record = {"t": record["t"], "node": record["node"], "attempt": int(record.get("attempt", 0))}
    if "gpus" in record:
        point["gpus"] = [{"index": g["index"], "error": g["error"]} if "error" in g else
                         {"index": g["index"], "total_bytes": g["total_bytes"], "used_bytes": g["used_bytes"]}
                         for g in record["gpus"]]
    if "ranks" in record:
        point["ranks"] = [{"rank": r["rank"], "pid": r.get("pid"), "rss_bytes": r["rss_bytes"],
                           "uss_bytes": r.get("uss_bytes")} for r in record["ranks"]]
    if record.get("ended"):
        point["ended"] = record["ended"]
    return point


def _peak(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _merge(a: Record, b: Record) -> Record:
    """One point standing for both (``a`` first): its time is ``a``'s, each value the peak of both."""
    gpus = {g["index"]: dict(g) for g in a.get("gpus", [])}
    for g in b.get("gpus", []):
        mine = gpus.setdefault(g["index"], dict(g))
        if "error" not in g and "error" not in mine:
            mine["used_bytes"] = max(mine["used_bytes"], g["used_bytes"])
        elif "error" in mine:
            gpus[g["index"]] = dict(g)
    ranks = {r["rank"]: dict(r) for r in a.get("ranks", [])}
    for r in b.get("ranks", []):
        mine = ranks.setdefault(r["rank"], dict(r))
        mine["rss_bytes"] = max(mine["rss_bytes"], r["rss_bytes"])
        mine["uss_bytes"] = _peak(mine.get("uss_bytes"), r.get("uss_bytes"))
    point = {k: v for k, v in a.items() if k not in ("gpus", "ranks", "ended")}
    if gpus or "gpus" in a or "gpus" in b:
        point["gpus"] = [gpus[i] for i in sorted(gpus)]
    if ranks or "ranks" in a or "ranks" in b:
        point["ranks"] = [ranks[r] for r in sorted(ranks)]
    if b.get("ended"):
        point["ended"] = b["ended"]
    return point


@dataclass
class Series:
    """Memory over time in at most ``max_points`` points (plus one per attempt boundary): each point
    stands for ``stride`` samples and holds their peaks; past ``max_points``, neighbours merge and
    the stride doubles. Points never span two attempts, so the plot still breaks at a requeue."""

    max_points: int = MAX_POINTS
    stride: int = 1
    points: list[Record] = field(default_factory=list)
    bucket: Record | None = None  # the point being filled
    bucket_count: int = 0

    def add(self, record: Record) -> None:
        point = _slim(record)
        if self.bucket is not None and (self.bucket["attempt"] != point["attempt"] or "ended" in self.bucket):
            self._close()
        if self.bucket is None:
            self.bucket, self.bucket_count = point, 1
        else:
            self.bucket, self.bucket_count = _merge(self.bucket, point), self.bucket_count + 1
        if self.bucket_count >= self.stride:
            self._close()

    def _close(self) -> None:
        if self.bucket is None:
            return
        self.points.append(self.bucket)
        self.bucket, self.bucket_count = None, 0
        if len(self.points) > self.max_points:
            self._halve()

    def _halve(self) -> None:
        merged: list[Record] = []
        for point in self.points:
            last = merged[-1] if merged else None
            if last is not None and not last.get("_pair") and last["attempt"] == point["attempt"] \
                    and "ended" not in last:
                merged[-1] = {**_merge(last, point), "_pair": True}
            else:
                merged.append(point)
        self.points = [{k: v for k, v in p.items() if k != "_pair"} for p in merged]
        self.stride *= 2

    def records(self) -> list[Record]:
        return self.points + ([self.bucket] if self.bucket is not None else [])

    def to_json(self) -> dict[str, Any]:
        return {"max_points": self.max_points, "stride": self.stride, "points": self.points,
                "bucket": self.bucket, "bucket_count": self.bucket_count}

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> Series:
        return cls(int(state["max_points"]), int(state["stride"]), list(state["points"]), state["bucket"],
                   int(state["bucket_count"]))


# -- reading the raw file -------------------------------------------------------------------------

def raw_records(raw: Path, start: int, end: int | None = None) -> Iterator[tuple[Record, int]]:
    """Each whole sample of ``raw`` from byte ``start`` (to ``end``), with the offset after its line.
    A ``start`` inside a line skips to the next; a line cut short by a kill is skipped."""
    with open(raw, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # mid-line: the rest of that line
        offset = f.tell()
        for line in f:
            if end is not None and offset >= end:
                return
            offset += len(line)
            if not line.endswith(b"\n"):
                return  # being written right now
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "t" in record and "node" in record:
                yield record, offset


def _load(path: str | Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            state = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("version") == VERSION else None


# -- the sampler's side ---------------------------------------------------------------------------

# The memory section of the run as its node's digest gives it, and what it was computed from
# (``summary.kept_memory``): written with the fold so a reader need not compute it again.
MemoryOf = Callable[[Digest], dict[str, Any]]


class NodeFold:
    """What the sampler folds of its node's file as it samples, and writes beside it."""

    def __init__(self, raw: Path, digest: Digest, digest_bytes: int, series: Series,
                 series_bytes: int, memory_of: MemoryOf | None = None) -> None:
        self.raw = raw
        self.digest, self.digest_bytes = digest, digest_bytes
        self.series, self.series_bytes = series, series_bytes
        self.memory_of = memory_of
        self._series_written = time.monotonic()

    @classmethod
    def resume(cls, raw: Path, memory_of: MemoryOf | None = None) -> NodeFold:
        """The fold of what ``raw`` holds already (a requeued job samples into the same file): the
        folds written beside it, brought up to the file's end; without them, the file folded whole."""
        size = raw.stat().st_size if raw.exists() else 0
        kept, shown = _load(fold_file(raw)), _load(series_file(raw))
        digest, digest_bytes = Digest(), 0
        if kept is not None and int(kept["raw_bytes"]) <= size:
            digest, digest_bytes = Digest.from_json(kept["digest"]), int(kept["raw_bytes"])
        series, series_bytes = Series(), 0
        if shown is not None and int(shown["raw_bytes"]) <= size:
            series, series_bytes = Series.from_json(shown["series"]), int(shown["raw_bytes"])
        fold = cls(raw, digest, digest_bytes, series, series_bytes, memory_of)
        if size > min(digest_bytes, series_bytes):
            for record, offset in raw_records(raw, min(digest_bytes, series_bytes)):
                fold.add(record, offset, write=False)
        return fold

    def add(self, record: Record, raw_bytes: int, write: bool = True) -> None:
        """Fold one sample whose line ends at ``raw_bytes`` of the raw file; then write the fold
        (and the series when due)."""
        if raw_bytes > self.digest_bytes:
            self.digest.add(record)
            self.digest_bytes = raw_bytes
        if raw_bytes > self.series_bytes:
            self.series.add(record)
            self.series_bytes = raw_bytes
        # Written when due and at the end, not every sample: each write is a file's fsync and rename
        # (per node, every 5 s, on a shared file system), and a reader folds what the raw file
        # gained since the last one (a minute of samples, far under TAIL_BYTES).
        if write and (time.monotonic() - self._series_written >= SERIES_EVERY_S or "ended" in record):
            self.write()

    def write(self) -> None:
        # no directory fsync: a lost rename leaves the previous fold, which readers bring up to date
        digest = self.digest.to_json()
        digest.pop("offsets", None)
        state = {"version": VERSION, "raw_bytes": self.digest_bytes, "digest": digest}
        # the kept section is an optimisation (readers summarise the fold without it): a failure
        # to make it must not keep the fold itself from being written
        with contextlib.suppress(Exception):
            if self.memory_of is not None:
                state["kept"] = self.memory_of(self.digest)
        atomic.write_json(fold_file(self.raw), state, durable=False)
        atomic.write_json(series_file(self.raw), {"version": VERSION, "raw_bytes": self.series_bytes,
                                                  "series": self.series.to_json()}, durable=False)
        self._series_written = time.monotonic()


# -- the readers' side ----------------------------------------------------------------------------

def _tail_start(size: int, start: int) -> int:
    return max(start, size - TAIL_BYTES)


def _no_fold_note(raw: Path, start: int, size: int, why: str) -> str:
    return (f"{raw.stem}: {why}: figures from the last {(size - start) / MIB:.1f} of its {size / MIB:.1f} "
            f"MiB of samples only (switchyard plot --raw reads them all)")


def read_digest(run_dir: Path, listing: Collection[str] | None = None) -> tuple[Digest, list[str]]:
    """Every node's fold merged, each brought up to its raw file's end, and notes on the nodes
    summarised from a part of their samples. Reads at most ``TAIL_BYTES`` of each raw file: the
    raw file itself is not opened when its fold covers it. ``listing``: as :func:`raw_files`'s."""
    digest, notes = Digest(), []
    for raw in raw_files(run_dir, listing):
        kept = _load(fold_file(raw))  # before the size: the sampler writes its fold after the samples
        size = raw.stat().st_size  # it covers, so a fold read first never ends past this size
        node, start = Digest(), 0
        if kept is not None and int(kept["raw_bytes"]) <= size:
            node, start = Digest.from_json(kept["digest"]), int(kept["raw_bytes"])
            why = "the sampler's fold is behind its samples (killed between its writes?)"
        else:
            why = "no folded summary (the sampler was killed before writing one, or an older " \
                  "Switchyard wrote these samples)"
        if size > start:
            first = _tail_start(size, start)
            if first > start:
                notes.append(_no_fold_note(raw, first, size, why))
            for record, _ in raw_records(raw, first):
                node.add(record)
        if digest.num_samples or digest.gpus or digest.ranks:
            digest.merge(node)
        else:
            digest = node  # the first node's fold as it is: most jobs have one node
    return digest, notes


def kept_memory(run_dir: str | Path, listing: Collection[str]) -> dict[str, Any] | None:
    """What the sampler of a job's only node kept with its fold (``NodeFold.memory_of``), when
    that fold covers every sample of the node's raw file; None otherwise (several nodes, no fold
    or one written without it, samples taken since): the caller summarises the fold instead.
    ``listing``: the names in the telemetry directory. Plain strings, no pathlib: ``status`` calls
    this for every job of a sweep that ended at once."""
    raws = [name for name in listing if name.endswith(".jsonl")]
    folded = raws[0].removesuffix(".jsonl") + ".fold.json" if len(raws) == 1 else None
    if folded is None or folded not in listing:
        return None
    state = _load(f"{run_dir}/telemetry/{folded}")  # before the size, as read_digest does
    if state is None:
        return None
    try:
        covers = int(state["raw_bytes"]) == os.stat(f"{run_dir}/telemetry/{raws[0]}").st_size
    except (OSError, KeyError, TypeError, ValueError):
        return None
    kept = state.get("kept") if covers else None
    return kept if isinstance(kept, dict) else None


def read_series(run_dir: Path) -> tuple[list[Record], list[str]]:
    """Every node's downsampled series and what its raw file gained since (at most ``TAIL_BYTES``
    of it), oldest first, and notes as :func:`read_digest`'s."""
    records, notes = [], []
    for raw in raw_files(run_dir):
        kept = _load(series_file(raw))  # before the size: the sampler writes its fold after the samples
        size = raw.stat().st_size  # it covers, so a fold read first never ends past this size
        start = 0
        if kept is not None and int(kept["raw_bytes"]) <= size:
            records += Series.from_json(kept["series"]).records()
            start = int(kept["raw_bytes"])
        if size > start:
            first = _tail_start(size, start)
            if first > start:
                notes.append(_no_fold_note(raw, first, size, "no downsampled series"))
            records += [record for record, _ in raw_records(raw, first)]
    return sorted(records, key=lambda r: r["t"]), notes

