"""Reading the samples back: every node's records, and per-GPU and per-rank statistics over the run."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

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
    util_samples: list[float] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)  # ranks whose own device this is
    process_peaks: dict[int, int | None] = field(default_factory=dict)  # rank -> peak bytes (None: unknown)

    @property
    def mean_util_pct(self) -> float | None:
        return statistics.fmean(self.util_samples) if self.util_samples else None

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
            self.util_samples.append(float(gpu["util_pct"]))
        self.ranks.update(gpu.get("ranks") or [])
        for p in gpu.get("processes") or []:
            if p.get("rank") is not None:
                self._add_process(int(p["rank"]), p.get("used_bytes"))

    def _add_process(self, rank: int, used: int | None) -> None:
        if rank not in self.process_peaks:
            self.process_peaks[rank] = used
        elif used is not None:
            self.process_peaks[rank] = max(self.process_peaks[rank] or 0, used)


def gpu_stats(records: Iterable[Record]) -> list[GpuStats]:
    stats: dict[tuple[str, int], GpuStats] = {}
    for record in records:
        for gpu in record.get("gpus") or []:
            if "error" not in gpu:
                key = (str(record["node"]), int(gpu["index"]))
                stats.setdefault(key, GpuStats(*key)).add(gpu)
    return [stats[k] for k in sorted(stats)]


@dataclass
class RankStats:
    """One rank's CPU memory over the run (sampled in CPU mode only)."""

    rank: int
    node: str
    pid: int
    peak_rss_bytes: int = 0
    peak_uss_bytes: int | None = None


def rank_stats(records: Iterable[Record]) -> list[RankStats]:
    stats: dict[int, RankStats] = {}
    for record in records:
        for r in record.get("ranks") or []:
            rank = int(r["rank"])
            s = stats.setdefault(rank, RankStats(rank, str(record["node"]), int(r["pid"])))
            s.peak_rss_bytes = max(s.peak_rss_bytes, int(r["rss_bytes"]))
            if r.get("uss_bytes") is not None:
                s.peak_uss_bytes = max(s.peak_uss_bytes or 0, int(r["uss_bytes"]))
    return [stats[k] for k in sorted(stats)]
