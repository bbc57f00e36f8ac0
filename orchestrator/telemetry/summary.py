"""The ``memory`` section of summary.json (per-GPU and per-rank peaks, flags, notes), and it as text."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path

from orchestrator.telemetry.common import Record, gib, rank_list
from orchestrator.telemetry.files import RankInfo, load_peaks, load_ranks, telemetry_dir
from orchestrator.telemetry.flags import cross_device_flags, idle_flags, imbalance_flags, uss_imbalance_flags
from orchestrator.telemetry.fold import NodeFold, kept_memory, read_digest
from orchestrator.telemetry.stats import Digest, GpuStats, RankStats


def summarize(run_dir: str | Path, listing: Collection[str] | None = None) -> Record:
    """The ``memory`` section of summary.json: per-GPU and per-rank peaks, and flags. JSON-serialisable.

    Works on a run still in progress (it reads what has been sampled so far) and on one that
    recorded nothing (mode ``"none"``). Reads what each node's sampler folded as it sampled, not
    the samples (``fold``): its time does not grow with how long the run ran. ``listing``: the
    names in its telemetry directory, when the caller has listed it (``status``, for thousands of
    jobs: the ranks' and peaks' directories are not looked for where the listing has none).

    A run of one node whose sampler's fold covers every sample is summarised from the memory
    section that sampler kept with it (:func:`sampler_fold`): one file, nothing computed.
    """
    if listing is None:
        try:
            listing = set(os.listdir(f"{run_dir}/telemetry"))
        except FileNotFoundError:
            listing = set()
    kept = _kept(run_dir, listing)
    if kept is not None:
        return kept
    digest, notes = read_digest(Path(run_dir), listing)
    return summary_of(Path(run_dir), digest, notes, listing)


def sampler_fold(run_dir: Path, raw: Path) -> NodeFold:
    """The fold a node's sampler keeps of ``raw``, with the run's memory section as that node's
    samples give it, so a reader of a one-node run computes nothing (:func:`summarize`)."""
    def memory_of(digest: Digest) -> Record:
        stamp = _ranks_stamp(run_dir)  # before they are read: a rank registering meanwhile moves it
        return {"ranks_stamp": stamp, "memory": summary_of(run_dir, digest)}

    return NodeFold.resume(raw, memory_of)


def _ranks_stamp(run_dir: str | Path, listing: Collection[str] | None = None) -> int | None:
    """When a rank last (re-)registered: each registration renames a file into ``ranks/``, which
    moves the directory's mtime. None: no rank registered."""
    if listing is not None and "ranks" not in listing:
        return None
    try:
        return os.stat(f"{run_dir}/telemetry/ranks").st_mtime_ns
    except FileNotFoundError:
        return None


def _kept(run_dir: str | Path, listing: Collection[str]) -> Record | None:
    """The memory section the sampler kept, if it still holds: every sample folded, no rank
    registered since, and no rank's end peak written (the peaks come after the last fold)."""
    if "peaks" in listing:
        return None
    kept = kept_memory(run_dir, listing)
    if kept is None or kept.get("ranks_stamp") != _ranks_stamp(run_dir, listing):
        return None
    memory = kept.get("memory")
    return memory if isinstance(memory, dict) else None


def summarize_raw(run_dir: Path) -> Record:
    """The same from every raw sample, folded here (what the sampler's fold must equal)."""
    digest = Digest()
    digest.read_new(run_dir)
    return summary_of(run_dir, digest)


def summary_of(run_dir: Path, digest: Digest, notes: list[str] | None = None,
               listing: Collection[str] | None = None) -> Record:
    """The memory section from the folded samples and the ranks' own files (small, read whole);
    ``notes``: what the fold's reader said (a node summarised from its last samples only)."""
    ranks = {r.rank: r for r in load_ranks(run_dir)} if listing is None or "ranks" in listing else {}
    peaks = load_peaks(run_dir) if listing is None or "peaks" in listing else {}
    gpus, cpu_ranks = digest.gpu_list(), digest.rank_list()
    flags = idle_flags(gpus) + imbalance_flags(gpus) + cross_device_flags(gpus, ranks, peaks) \
        + uss_imbalance_flags(cpu_ranks)
    return {"mode": "gpu" if gpus else "cpu" if cpu_ranks else "none",
            **_sampling(digest),
            "gpus": [_gpu_summary(g) for g in gpus],
            "ranks": _ranks_summary(ranks, peaks, cpu_ranks),
            "nodes": [{"node": n.node, "peak_total_rss_bytes": n.peak_total_rss_bytes,
                       "peak_total_uss_bytes": n.peak_total_uss_bytes}
                      for _, n in sorted(digest.nodes.items())],
            "flags": flags,
            "notes": _notes(digest, run_dir) + list(notes or [])}


def _sampling(digest: Digest) -> Record:
    first, last, most = digest.first_t, digest.last_t, digest.cost_max
    mean = digest.cost_sum / digest.cost_count if digest.cost_count else None
    return {"num_samples": digest.num_samples,
            "duration_s": round(last - first, 3) if first is not None and last is not None else 0.0,
            "sample_cost_ms": {"mean": round(1e3 * mean, 3) if mean is not None else None,
                               "max": round(1e3 * most, 3) if most is not None else None}}


def _gpu_summary(g: GpuStats) -> Record:
    util = g.mean_util_pct
    return {"node": g.node, "index": g.index, "total_bytes": g.total_bytes,
            "peak_used_bytes": g.peak_used_bytes,
            "mean_util_pct": None if util is None else round(util, 1), "ranks": sorted(g.ranks),
            "processes": [{"rank": r, "peak_used_bytes": b} for r, b in sorted(g.process_peaks.items())]}


def _ranks_summary(ranks: Mapping[int, RankInfo], peaks: Mapping[int, Record],
                   cpu_ranks: list[RankStats]) -> list[Record]:
    sampled = {s.rank: s for s in cpu_ranks}
    result = []
    for rank in sorted(set(ranks) | set(peaks) | set(sampled)):
        info, s = ranks.get(rank), sampled.get(rank)
        result.append({"rank": rank, "node": info.node if info else (s.node if s else None),
                       "local_rank": info.local_rank if info else None, "pid": info.pid if info else None,
                       "device": info.device if info else None,
                       "peak_rss_bytes": s.peak_rss_bytes if s else None,
                       "peak_uss_bytes": s.peak_uss_bytes if s else None,
                       "end": peaks.get(rank)})
    return result


def _notes(digest: Digest, run_dir: Path) -> list[str]:
    notes = []
    if not digest.num_samples:
        notes.append(f"no telemetry samples in {telemetry_dir(run_dir)}: was the memory sampler started?")
    if digest.processes_listed and not digest.processes_matched:
        notes.append("NVML's process ids match no rank's pid (a container's PID namespace?): per-rank GPU "
                     "memory comes from torch's allocator at the end of the run only")
    return notes


def format_summary(memory: Record) -> str:
    """The memory section as text, for ``switchyard status``."""
    lines = [f"memory ({memory['mode']}, {memory['num_samples']} samples over {memory['duration_s']:.0f} s, "
             f"{memory['sample_cost_ms']['mean'] or 0:.2f} ms per sample)"]
    for g in memory["gpus"]:
        util = "  n/a" if g["mean_util_pct"] is None else f"{g['mean_util_pct']:4.0f}%"
        lines.append(f"  {g['node']} GPU {g['index']}: peak {gib(g['peak_used_bytes']):>5} / "
                     f"{gib(g['total_bytes'])} GiB, mean util {util}, {rank_list(g['ranks'])}")
    if memory["mode"] == "cpu":
        for r in memory["ranks"]:
            uss = "n/a" if r["peak_uss_bytes"] is None else gib(r["peak_uss_bytes"])
            lines.append(f"  {r['node']} rank {r['rank']}: peak RSS {gib(r['peak_rss_bytes'] or 0)} GiB, "
                         f"USS {uss} GiB")
        for n in memory["nodes"]:
            lines.append(f"  {n['node']} all ranks: peak RSS {gib(n['peak_total_rss_bytes'])} GiB, "
                         f"USS {gib(n['peak_total_uss_bytes'])} GiB")
    lines += [f"  ! {flag}" for flag in memory["flags"]] + [f"  note: {note}" for note in memory["notes"]]
    return "\n".join(lines)
