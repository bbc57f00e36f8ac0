"""The files each rank writes under ``RUN/telemetry/``, and reading them back.

Layout::

    <node>.jsonl          one JSON line per sample, written by that node's sampler (local rank 0)
    <node>.fold.json      that sampler's statistics of every sample so far, and <node>.series.json
                          its downsampled series (``fold``): what status and plot read
    ranks/rank-<R>.json   written by each rank at start: who it is, its pid and its device
    peaks/rank-<R>.json   written by each rank at the end: torch's peak memory, or peak RSS on CPU
    end-summary.json      written by rank 0 when the run fails: the memory section as it ended
                          (a run that ends well puts it in RUN/summary.json instead)
"""

from __future__ import annotations

import json
import os
import re
import resource
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from durable import atomic
from orchestrator.telemetry.common import Record


def telemetry_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "telemetry"


def node_file(run_dir: Path, node: str) -> Path:
    # node names come from the launcher; keep them from escaping the directory or breaking the name
    return telemetry_dir(run_dir) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', node)}.jsonl"


def _write_json_atomic(path: Path, obj: object) -> None:
    """A killed rank leaves the old file or the new one; rewritten often, so no directory fsync."""
    atomic.write_json(path, obj, durable=False)


@dataclass(frozen=True)
class RankInfo:
    """One rank as it registered itself: the sampler maps NVML's pids and its own device through this."""

    rank: int
    local_rank: int
    node: str
    pid: int
    device: int | None  # CUDA ordinal in this rank's own view; None on CPU
    cuda_visible_devices: str | None  # this rank's view, which may differ from the sampler's (gpu-bind)
    device_uuid: str | None = None  # the device's UUID from CUDA: the sampler finds it in NVML by it


def register_rank(run_dir: Path, rank: int, local_rank: int, node: str, device_index: int | None,
                  environ: Mapping[str, str] | None = None, pid: int | None = None,
                  device_uuid: str | None = None) -> None:
    """Each rank at start: write ``telemetry/ranks/rank-<R>.json`` (``pid`` defaults to this process)."""
    env = os.environ if environ is None else environ
    info = RankInfo(rank=rank, local_rank=local_rank, node=node, pid=os.getpid() if pid is None else pid,
                    device=device_index, cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                    device_uuid=device_uuid)
    _write_json_atomic(telemetry_dir(run_dir) / "ranks" / f"rank-{rank}.json", asdict(info))


def read_rank(path: Path) -> RankInfo | None:
    try:
        with open(path, "rb") as f:
            return RankInfo(**json.loads(f.read()))
    except (OSError, ValueError, TypeError):
        return None  # a foreign or damaged file: that rank is simply unknown


def _rank_files(directory: Path) -> list[Path]:
    """``rank-*.json`` in ``directory`` (os.scandir: status calls this for thousands of jobs)."""
    try:
        names = [e.name for e in os.scandir(directory)
                 if e.name.startswith("rank-") and e.name.endswith(".json")]
    except FileNotFoundError:
        return []
    return [directory / name for name in sorted(names)]


def load_ranks(run_dir: Path) -> list[RankInfo]:
    paths = _rank_files(telemetry_dir(run_dir) / "ranks")
    return sorted((r for r in map(read_rank, paths) if r is not None), key=lambda r: r.rank)


def record_rank_peak(run_dir: Path, rank: int, device_index: int | None,
                     floor: Mapping[str, int] | None = None) -> Record:
    """Each rank at the end: write (and return) its peak memory to ``telemetry/peaks/rank-<R>.json``.

    On GPU: torch's peak allocated/reserved bytes on its device, and on any other device its
    allocator touched (the "loaded onto cuda:0" mistake, seen even where NVML's pids are a
    container's). Always: peak RSS (``ru_maxrss``) and current USS of the process. ``floor``
    (``allocated``, ``reserved``, ``rss``): peaks the trainer kept while it reset the counters
    once per logging window, so the run's peak survives the resets.
    """
    low = dict(floor or {})
    usage_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak: Record = {"rank": rank, "device": device_index,
                    "max_rss_bytes": max(usage_kib * 1024, low.get("rss", 0)),
                    "uss_bytes": psutil.Process().memory_full_info().uss}
    if device_index is not None:
        peak.update(_cuda_peak(device_index))
        peak["max_allocated_bytes"] = max(peak["max_allocated_bytes"], low.get("allocated", 0))
        peak["max_reserved_bytes"] = max(peak["max_reserved_bytes"], low.get("reserved", 0))
    _write_json_atomic(telemetry_dir(run_dir) / "peaks" / f"rank-{rank}.json", peak)
    return peak


def _cuda_peak(device_index: int) -> Record:
    import torch  # only ranks that train on a GPU pay for importing torch here

    others = []
    for i in range(torch.cuda.device_count()):
        # reads the caching allocator's counters: creates no CUDA context on devices never used
        reserved = torch.cuda.max_memory_reserved(i)
        if i != device_index and reserved > 0:
            others.append({"device": i, "max_reserved_bytes": reserved})
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device_index),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(device_index), "other_devices": others}


def load_peaks(run_dir: Path) -> dict[int, Record]:
    peaks: dict[int, Record] = {}
    for path in _rank_files(telemetry_dir(run_dir) / "peaks"):
        try:
            record = json.loads(path.read_text())
            peaks[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed before it wrote its peak has none
    return peaks


# -- the memory section of a run that failed ---------------------------------------------------------
# Rank 0 of a run that fails summarises the telemetry once, then: ``switchyard status`` on thousands
# of failed jobs reads one small file per job instead of every job's samples (1 ms per job at 60
# samples, 0.2 s at a day of them). A run that ends well puts it in RUN/summary.json instead.

def end_summary_file(run_dir: Path) -> Path:
    return telemetry_dir(run_dir) / "end-summary.json"


def write_end_summary(run_dir: Path, memory: Record) -> None:
    _write_json_atomic(end_summary_file(run_dir), memory)


def read_end_summary(run_dir: str | Path) -> Record | None:
    """What :func:`write_end_summary` wrote, or None."""
    try:
        with open(end_summary_file(Path(run_dir)), "rb") as f:
            memory = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return memory if isinstance(memory, dict) else None


def clear_end_summary(run_dir: Path) -> None:
    """Rank 0 as a run (re)starts: an earlier attempt's end is not this one's."""
    end_summary_file(run_dir).unlink(missing_ok=True)
