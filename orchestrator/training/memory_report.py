"""What a rank reports about memory: the node's sampler, this rank's peaks, and the summary's
``memory`` section (the telemetry's figures and flags, beside the estimate made before submission).

A failing run's rank 0 still summarises the telemetry once (``keep_end_summary``), so that
``switchyard status`` shows the memory of a run that died of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.config import TrainConfig
from orchestrator.launch.dist_env import DistEnv
from orchestrator.telemetry.files import record_rank_peak, write_end_summary
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.summary import summarize
from orchestrator.training import estimate
from orchestrator.training.metrics import WindowPeaks


def node_sampler(cfg: TrainConfig, run: Path, env: DistEnv, cuda_uuids: list[str] | None
                 ) -> MemorySampler | None:
    """One memory sampler per node (local rank 0), for the whole job."""
    if not (cfg.telemetry.enabled and env.is_local_main):
        return None
    return MemorySampler(run, env.hostname, cfg.telemetry.interval_s, cuda_uuids=cuda_uuids,
                         attempt=env.restart_count)


def record_peaks(run: Path, env: DistEnv, device_index: int | None, peaks: WindowPeaks) -> None:
    """This rank's peaks for the telemetry, the trainer's run peaks as their floor (the trainer
    reset the counters at every log step)."""
    record_rank_peak(run, env.rank, device_index, floor=peaks.run_peaks())


def for_summary(run: Path) -> dict[str, Any]:
    """Rank 0, once every node's sampler has stopped and every peak is written: ``memory`` (the
    telemetry's summary) and ``memory_estimate`` (the report jobs.train wrote before submission)."""
    return {"memory": summarize(run), "memory_estimate": estimate.read_report(run)}


def print_flags(memory: dict[str, Any]) -> None:
    for flag in memory["flags"]:
        print(f"memory warning: {flag}", flush=True)


def keep_end_summary(run: Path) -> None:
    """Rank 0 of a failing run: its memory section, summarised once for ``switchyard status``.
    Never raises: the run's own error is what the job reports."""
    try:
        write_end_summary(run, summarize(run))
    except Exception as e:
        print(f"could not summarise the telemetry at the failure: {type(e).__name__}: {e}", flush=True)
