"""Reading the samples back: every node's records, and per-GPU and per-rank statistics over the run.

Every statistic is a fold over the samples (peaks, sums, counts), so :class:`Digest` can take a
run's files in pieces: a running job's digest is kept between ``switchyard status`` calls and
only the lines sampled since are read (a day of samples is 0.2 s per job to parse again).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.telemetry.common import Record
from orchestrator.telemetry.files import telemetry_dir


def load_records(run_dir: Path) -> list[Record]:
    """Every node's samples, oldest first. A line cut short by a kill is skipped."""
    records = []
    for path in sorted(telemetry_dir(run_dir).glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "t" in record and "node" in record:
                    records.append(record)
    return sorted(records, key=lambda r: r["t"])


@dataclass
class GpuStats:
    """One GPU over the run, accumulated from its samples."""

    node: str
    index: int
    total_bytes: int = 0
    peak_used_bytes: int = 0
    num_samples: int = 0
    util_sum: float = 0.0  # over the samples that reported utilisation
    util_count: int = 0
    ranks: set[int] = field(default_factory=set)  # ranks whose own device this is
    process_peaks: dict[int, int | None] = field(default_factory=dict)  # rank -> peak bytes (None: unknown)

    @property
    def mean_util_pct(self) -> float | None:
        return self.util_sum / self.util_count if self.util_count else None

    @property
    def ranks_present(self) -> set[int]:
        """Ranks that own this GPU or whose process NVML lists on it."""
        return self.ranks | set(self.process_peaks)

    @property
    def name(self) -> str:
        return f"GPU {self.index} on {self.node}"

    def add(self, gpu: Record) -> None:
        self.num_samples += 1
        self.total_bytes = int(gpu["total_bytes"])
        self.peak_used_bytes = max(self.peak_used_bytes, int(gpu["used_bytes"]))
        if gpu.get("util_pct") is not None:
            self.util_sum += float(gpu["util_pct"])
            self.util_count += 1
        self.ranks.update(gpu.get("ranks") or [])
        for p in gpu.get("processes") or []:
            if p.get("rank") is not None:
                self._add_process(int(p["rank"]), p.get("used_bytes"))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ranks": sorted(self.ranks),
                "process_peaks": [[r, b] for r, b in self.process_peaks.items()]}

    @classmethod
    def from_json(cls, g: dict[str, Any]) -> GpuStats:
        return cls(**{**g, "ranks": set(g["ranks"]),
                        "process_peaks": {int(r): b for r, b in g["process_peaks"]}})

    def merge(self, other: GpuStats) -> None:
        """Fold in another fold of the same GPU (its samples, taken by another file's reader)."""
        self.num_samples += other.num_samples
        self.total_bytes = other.total_bytes or self.total_bytes
        self.peak_used_bytes = max(self.peak_used_bytes, other.peak_used_bytes)
        self.util_sum, self.util_count = self.util_sum + other.util_sum, self.util_count + other.util_count
        self.ranks |= other.ranks
        for rank, used in other.process_peaks.items():
            self._add_process(rank, used)

    def _add_process(self, rank: int, used: int | None) -> None:
        if rank not in self.process_peaks:
            self.process_peaks[rank] = used
        elif used is not None:
            self.process_peaks[rank] = max(self.process_peaks[rank] or 0, used)


@dataclass
class RankStats:
    """One rank's CPU memory over the run (sampled in CPU mode only)."""

    rank: int
    node: str
    pid: int
    peak_rss_bytes: int = 0
    peak_uss_bytes: int | None = None

    def add(self, r: Record) -> None:
        self.peak_rss_bytes = max(self.peak_rss_bytes, int(r["rss_bytes"]))
        if r.get("uss_bytes") is not None:
            self.peak_uss_bytes = max(self.peak_uss_bytes or 0, int(r["uss_bytes"]))

    def merge(self, other: RankStats) -> None:
        """The same rank sampled on another node (a requeue that moved it)."""
        self.peak_rss_bytes = max(self.peak_rss_bytes, other.peak_rss_bytes)
        if other.peak_uss_bytes is not None:
            self.peak_uss_bytes = max(self.peak_uss_bytes or 0, other.peak_uss_bytes)


@dataclass
class NodeTotals:
    """CPU mode: one node's peak of its ranks' summed RSS (shared pages counted once per rank) and
    summed USS (private). Summed USS near summed RSS means every rank holds its own copy (a dataset
    loaded per process); far below it, the ranks share pages (memory-mapped shards, fork). USS is
    read less often than RSS, so each rank's last reading stands in until the next."""

    node: str
    peak_total_rss_bytes: int = 0
    peak_total_uss_bytes: int = 0
    last_uss: dict[int, int] = field(default_factory=dict)  # rank -> its last USS reading

    def add(self, ranks: list[Record]) -> None:
        for r in ranks:
            if r.get("uss_bytes") is not None:
                self.last_uss[int(r["rank"])] = int(r["uss_bytes"])
        rss = sum(int(r["rss_bytes"]) for r in ranks)
        uss = sum(self.last_uss.get(int(r["rank"]), 0) for r in ranks)
        self.peak_total_rss_bytes = max(self.peak_total_rss_bytes, rss)
        self.peak_total_uss_bytes = max(self.peak_total_uss_bytes, uss)


@dataclass
class Digest:
    """Every statistic the summary needs, folded sample by sample; JSON-serialisable, and resumable
    on a run's files (``offsets``: bytes of each node's file folded so far)."""

    num_samples: int = 0
    first_t: float | None = None
    last_t: float | None = None
    cost_sum: float = 0.0
    cost_count: int = 0
    cost_max: float | None = None
    gpus: dict[tuple[str, int], GpuStats] = field(default_factory=dict)
    ranks: dict[int, RankStats] = field(default_factory=dict)
    nodes: dict[str, NodeTotals] = field(default_factory=dict)
    processes_listed: int = 0  # processes NVML listed on the GPUs, over all samples
    processes_matched: int = 0  # those whose pid matched a rank
    offsets: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, records: Iterable[Record]) -> Digest:
        digest = cls()
        for record in records:
            digest.add(record)
        return digest

    def add(self, record: Record) -> None:
        """Fold one sample in. A node's samples must come in their order (its file's)."""
        t, node = float(record["t"]), str(record["node"])
        self.num_samples += 1
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)
        if "sample_s" in record:
            cost = float(record["sample_s"])
            self.cost_sum, self.cost_count = self.cost_sum + cost, self.cost_count + 1
            self.cost_max = cost if self.cost_max is None else max(self.cost_max, cost)
        for gpu in record.get("gpus") or []:
            if "error" not in gpu:
                key = (node, int(gpu["index"]))
                self.gpus.setdefault(key, GpuStats(*key)).add(gpu)
            for p in gpu.get("processes") or []:
                self.processes_listed += 1
                self.processes_matched += p.get("rank") is not None
        ranks = record.get("ranks") or []
        for r in ranks:
            rank = int(r["rank"])
            self.ranks.setdefault(rank, RankStats(rank, node, int(r["pid"]))).add(r)
        if ranks:
            self.nodes.setdefault(node, NodeTotals(node)).add(ranks)

    def merge(self, other: Digest) -> None:
        """Fold in another digest (another node's file): every statistic is a peak, sum or count,
        so merging folds equals folding every sample once."""
        self.num_samples += other.num_samples
        ts = [t for t in (self.first_t, other.first_t) if t is not None]
        self.first_t = min(ts) if ts else None
        ts = [t for t in (self.last_t, other.last_t) if t is not None]
        self.last_t = max(ts) if ts else None
        self.cost_sum, self.cost_count = self.cost_sum + other.cost_sum, self.cost_count + other.cost_count
        costs = [c for c in (self.cost_max, other.cost_max) if c is not None]
        self.cost_max = max(costs) if costs else None
        for key, g in other.gpus.items():
            if key in self.gpus:
                self.gpus[key].merge(g)
            else:
                self.gpus[key] = GpuStats.from_json(g.to_json())
        for rank, r in other.ranks.items():
            if rank in self.ranks:
                self.ranks[rank].merge(r)
            else:
                self.ranks[rank] = RankStats(**asdict(r))
        for node, n in other.nodes.items():  # one file per node: a node is never in both
            self.nodes[node] = NodeTotals(**{**asdict(n), "last_uss": dict(n.last_uss)})
        self.processes_listed += other.processes_listed
        self.processes_matched += other.processes_matched

    def read_new(self, run_dir: Path) -> None:
        """Fold what each node's file gained since the last call (whole lines only: the sampler
        may be writing one). A file shorter than what was folded was replaced: everything is
        folded again from the start."""
        paths = sorted(telemetry_dir(run_dir).glob("*.jsonl"))
        if any(path.stat().st_size < self.offsets.get(path.name, 0) for path in paths):
            self.clear()
        for path in paths:
            start = self.offsets.get(path.name, 0)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            for line in whole.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(record, dict) and "t" in record and "node" in record:
                    self.add(record)
            self.offsets[path.name] = start + len(whole)

    def clear(self) -> None:
        """Back to nothing folded (a replaced file, or a fold that failed part way)."""
        vars(self).update(vars(Digest()))

    def gpu_list(self) -> list[GpuStats]:
        return [self.gpus[k] for k in sorted(self.gpus)]

    def rank_list(self) -> list[RankStats]:
        return [self.ranks[k] for k in sorted(self.ranks)]

    def to_json(self) -> dict[str, Any]:
        state = asdict(self)
        state["gpus"] = [g.to_json() for g in self.gpus.values()]
        state["ranks"] = [asdict(r) for r in self.ranks.values()]
        state["nodes"] = [{**asdict(n), "last_uss": [[r, b] for r, b in n.last_uss.items()]}
                          for n in self.nodes.values()]
        return state

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> Digest:
        digest = cls(**{k: v for k, v in state.items() if k not in ("gpus", "ranks", "nodes")})
        for g in state["gpus"]:
            stats = GpuStats.from_json(g)
            digest.gpus[(stats.node, stats.index)] = stats
        digest.ranks = {int(r["rank"]): RankStats(**r) for r in state["ranks"]}
        digest.nodes = {n["node"]: NodeTotals(**{**n, "last_uss": {int(r): b for r, b in n["last_uss"]}})
                        for n in state["nodes"]}
        return digest
