"""Flags in plain words: idle GPUs, one GPU far above its peers, a rank on another rank's GPU, and (on
CPU) a rank whose private memory is far above its peers'.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from orchestrator.telemetry.common import GIB, MIB, Record, gib, rank_list
from orchestrator.telemetry.files import RankInfo
from orchestrator.telemetry.stats import GpuStats, RankStats

# Idle: NVML utilisation is the share of the last ~1/6-1 s a kernel ran; a training GPU averages far
# above 5 %, and a CUDA context plus NCCL buffers (~0.5-1 GiB) stays under 5 % of a 24-80 GiB card.
IDLE_UTIL_PCT = 5.0
IDLE_PEAK_FRACTION = 0.05
# A job that stopped during start-up (data loading, compilation) never had the chance to use its GPUs.
MIN_SAMPLES_FOR_IDLE = 3

# Imbalance: DDP replicas hold the same model, gradients and optimizer state, so their peaks agree
# within ~10-20 %. 1.5x the median of the peers is a different workload; the absolute floor keeps
# small models (0.3 vs 0.6 GiB of context and workspace) from being flagged.
IMBALANCE_RATIO = 1.5
IMBALANCE_MIN_EXCESS_BYTES = 1 * GIB

# A stray CUDA context alone is ~300 MiB; below 16 MiB NVML's per-process figure is driver bookkeeping.
CROSS_DEVICE_MIN_BYTES = 16 * MIB


def is_idle(gpu: GpuStats) -> bool:
    util = gpu.mean_util_pct
    return (gpu.num_samples >= MIN_SAMPLES_FOR_IDLE and util is not None and util < IDLE_UTIL_PCT
            and gpu.peak_used_bytes < IDLE_PEAK_FRACTION * gpu.total_bytes)


def idle_flags(gpus: list[GpuStats]) -> list[str]:
    """A GPU the job holds that did no work; names the GPU that several ranks crowd onto, if any."""
    flags = []
    for g in filter(is_idle, gpus):
        flag = (f"{g.name} ({rank_list(g.ranks)}) stayed idle: mean utilisation {g.mean_util_pct:.0f}%, "
                f"peak {gib(g.peak_used_bytes)} of {gib(g.total_bytes)} GiB")
        for c in (c for c in gpus if c is not g and c.node == g.node and len(c.ranks_present) > 1):
            flag += (f"; {rank_list(c.ranks_present)} all run on GPU {c.index}: "
                     f"call torch.cuda.set_device(local_rank) in each rank before creating tensors")
        flags.append(flag)
    return flags


def _outliers(values: Mapping[Any, float]) -> Iterator[tuple[Any, float]]:
    """Keys whose value exceeds IMBALANCE_RATIO x the median of the others by IMBALANCE_MIN_EXCESS_BYTES."""
    for key, value in values.items():
        peers = [v for k, v in values.items() if k != key]
        if not peers:
            continue
        median = statistics.median(peers)
        if value > IMBALANCE_RATIO * median and value - median > IMBALANCE_MIN_EXCESS_BYTES:
            yield key, median


def _ratio(value: float, median: float) -> str:
    return f"{value / median:.1f}x the median of its peers ({gib(median)} GiB)" if median > 0 \
        else "while its peers hold none"


def heavy_gpus(gpus: list[GpuStats]) -> list[tuple[GpuStats, float]]:
    """GPUs holding far more than the job's other working GPUs, with their peers' median peak.

    Idle GPUs are no yardstick (and are flagged on their own): peers are all working GPUs of the
    job, across nodes, so "GPU 0 heavy on every node" still stands out against GPUs 1-3.
    """
    working = {(g.node, g.index): g for g in gpus if not is_idle(g)}
    return [(working[k], median)
            for k, median in _outliers({k: float(g.peak_used_bytes) for k, g in working.items()})]


def imbalance_flags(gpus: list[GpuStats]) -> list[str]:
    flags = []
    for g, median in heavy_gpus(gpus):
        guests = sorted(set(g.process_peaks) - g.ranks)
        cause = (f"{rank_list(guests)} also hold memory here: something is loaded onto this GPU by "
                 f"every rank? load checkpoints with map_location='cpu'" if guests
                 else "something is loaded onto this GPU by every rank? load checkpoints with "
                      "map_location='cpu'; or one rank keeps extra tensors (metrics, evaluation)")
        flags.append(f"{g.name} peaked at {gib(g.peak_used_bytes)} GiB, "
                     f"{_ratio(g.peak_used_bytes, median)}: {cause}")
    return flags


def cross_device_flags(gpus: list[GpuStats], ranks: Mapping[int, RankInfo],
                       peaks: Mapping[int, Record]) -> list[str]:
    """A rank holding memory on a GPU other than its own: NVML's process lists, else torch's allocator."""
    own = {(g.node, r): g.index for g in gpus for r in g.ranks}
    flags, flagged = [], set()
    for g in gpus:
        for rank, used in sorted(g.process_peaks.items()):
            mine = own.get((g.node, rank))
            if mine is None or mine == g.index or (used is not None and used < CROSS_DEVICE_MIN_BYTES):
                continue
            amount = "an unknown amount" if used is None else f"{gib(used)} GiB"
            pid = f" (pid {ranks[rank].pid})" if rank in ranks else ""
            flags.append(f"rank {rank}{pid} holds {amount} on {g.name}, its own device is GPU {mine}: "
                         f"call torch.cuda.set_device(local_rank) first and load with map_location='cpu'")
            flagged.add(rank)
    for rank, peak in sorted(peaks.items()):
        if rank not in flagged:
            flags += _torch_cross_device(rank, peak)
    return flags


def _torch_cross_device(rank: int, peak: Record) -> list[str]:
    return [f"rank {rank} reserved {gib(o['max_reserved_bytes'])} GiB on cuda:{o['device']} through torch, "
            f"its own device is cuda:{peak.get('device')}: call torch.cuda.set_device(local_rank) first "
            f"and load with map_location='cpu'"
            for o in peak.get("other_devices") or [] if o["max_reserved_bytes"] >= CROSS_DEVICE_MIN_BYTES]


def uss_imbalance_flags(stats: list[RankStats]) -> list[str]:
    """CPU mode: a rank whose private memory (USS) is far above its peers'."""
    by_rank = {s.rank: s for s in stats if s.peak_uss_bytes is not None}
    flags = []
    for rank, median in _outliers({r: float(s.peak_uss_bytes or 0) for r, s in by_rank.items()}):
        s = by_rank[rank]
        flags.append(f"rank {rank} on {s.node} peaked at {gib(s.peak_uss_bytes or 0)} GiB of private memory "
                     f"(USS), {_ratio(s.peak_uss_bytes or 0, median)}: it keeps something the others "
                     f"do not (evaluation data, a second copy of the dataset?)")
    return flags
