"""What each job of a sweep shows (progress, loss, memory), read from its run directory and kept
in the registry once its attempt has ended.

Below both the launcher (which keeps a blocking sweep's results as it ends) and ``status`` (which
shows them): neither imports the other. Importing this module stays cheap: no Hydra, submitit or
torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.registry.db import Attempt, Job, Registry, Result
from orchestrator.registry.states import SUBMITTED, SUBMITTING, TERMINAL_STATES
from orchestrator.telemetry.files import read_end_summary
from orchestrator.telemetry.summary import summarize

LIVE_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"})  # runtime still counts


@dataclass(frozen=True)
class JobRow:
    job: Job
    attempt: Attempt | None
    result: Result  # progress, loss and memory: kept in the registry once the attempt ended

    @property
    def step(self) -> int | None:
        return self.result.step

    @property
    def loss(self) -> float | None:
        return self.result.loss

    @property
    def memory(self) -> dict[str, Any] | None:
        """summary.json's memory section (telemetry so far if running)."""
        return self.result.memory

    def runtime_s(self, now: float) -> float | None:
        a = self.attempt
        if a is None or a.started_at is None:
            return None
        if a.ended_at is not None:
            return max(a.ended_at - a.started_at, 0.0)
        return max(now - a.started_at, 0.0) if a.state in LIVE_STATES else None

    def as_json(self, now: float) -> dict[str, Any]:
        a = self.attempt
        return {"job": self.job.ref, "num": self.job.num, "overrides": self.job.overrides,
                "state": a.state if a else None, "attempt": a.attempt if a else 0,
                "requeues": a.requeues if a else 0, "slurm_id": a.slurm_id if a else None,
                "node": a.node if a else None, "exit_code": a.exit_code if a else None,
                "error": a.error if a else None, "step": self.step, "total_steps": self.job.total_steps,
                "loss": self.loss, "runtime_s": self.runtime_s(now),
                "started_at": a.started_at if a else None, "ended_at": a.ended_at if a else None,
                "run_dir": self.job.run_dir, "log_dir": a.log_dir if a else None,
                "memory": self.memory}


def last_metrics(run_dir: str) -> dict[str, Any] | None:
    """The last complete training line of RUN/metrics.jsonl (the trainer appends one per log step,
    and one per evaluation)."""
    try:
        with open(f"{run_dir}/metrics.jsonl", "rb") as f:  # not os.path.join: status reads thousands
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            value = json.loads(line)
        except ValueError:
            continue  # a line being written right now
        if isinstance(value, dict) and "train_loss" in value:
            return value
    return None


def read_result(run_dir: str) -> Result:
    """What the run directory shows now: the last metrics line and the memory section."""
    metrics = last_metrics(run_dir) or {}
    step, loss = metrics.get("step"), metrics.get("train_loss")
    memory = job_memory(run_dir)
    flags = memory.get("flags") if memory else None
    return Result(step if isinstance(step, int) else None,
                  float(loss) if isinstance(loss, int | float) else None, peak_bytes(memory),
                  [str(f) for f in flags] if isinstance(flags, list) else [],
                  json.dumps(memory) if memory else None)


_NO_RESULT = Result(None, None, None, [], None)
_NOT_STARTED = frozenset({SUBMITTING, SUBMITTED, "PENDING"})


def _has_not_run(attempt: Attempt | None) -> bool:
    """A job's first attempt, queued and never started: its run directory holds nothing yet, so
    a 10,000-job sweep still pending opens no files. A queued retry is read: it resumes from
    what the run directory holds, and that progress is what status shows."""
    return attempt is not None and attempt.attempt == 1 and attempt.state in _NOT_STARTED \
        and attempt.started_at is None and attempt.requeues == 0


def job_rows(registry: Registry, sweep_id: int, num: int | None = None) -> list[JobRow]:
    """Each job (or job ``num``) with its latest attempt and what its run directory shows.

    An attempt that has ended is read from its files once; its result is kept in the registry and
    later calls read that instead (a requeue or correction of the attempt drops it). A first
    attempt still queued has nothing to read yet. One still running is read each call: its
    memory from what its sampler folded (``telemetry.fold``), never its samples. Every row is
    whole: an ended job's files are a summary.json, rank 0's end summary or its sampler's fold,
    each one small file, so 10,000 jobs killed at once are read in about a second.
    """
    if num is None:
        jobs = registry.jobs(sweep_id, resources=False)  # not shown: not decoded
        latest = registry.latest_attempts(sweep_id)
    else:
        attempts = registry.attempts(sweep_id, num)
        jobs, latest = [registry.job(sweep_id, num)], ({num: attempts[-1]} if attempts else {})
    kept = registry.results(sweep_id, num)
    rows, ended = [], []
    for job in jobs:
        attempt = latest.get(job.num)
        result = kept.get(attempt.id) if attempt else None
        if result is None and _has_not_run(attempt):
            result = _NO_RESULT
        elif result is None:
            result = read_result(job.run_dir)
            if attempt is not None and attempt.state in TERMINAL_STATES:
                ended.append((attempt, result))
        rows.append(JobRow(job, attempt, result))
    if ended:
        registry.keep_results(ended)
    return rows


def keep_ended_results(registry: Registry, sweep_id: int) -> None:
    """Read what each ended job of the sweep left, once, into the registry (about 0.1 ms per job:
    a blocking sweep does it as it ends, so its first ``status`` reads no job files)."""
    job_rows(registry, sweep_id)


def job_memory(run_dir: str) -> dict[str, Any] | None:
    """The run's memory section: from summary.json once it ended, from what rank 0 summarised as
    it failed, else from what each node's sampler folded so far (a run still going, or one killed
    outright): never more than ``fold.TAIL_BYTES`` of a node's raw samples."""
    try:
        with open(f"{run_dir}/summary.json", "rb") as f:
            memory = json.loads(f.read()).get("memory")
        return memory if isinstance(memory, dict) else None
    except (OSError, ValueError, AttributeError):
        pass
    try:  # one listing says which of the files below exist: none is looked for in vain
        listing = set(os.listdir(f"{run_dir}/telemetry"))
    except OSError:
        return None  # no telemetry directory: nothing was sampled
    if "end-summary.json" in listing and (memory := read_end_summary(run_dir)) is not None:
        return memory
    try:
        return summarize(run_dir, listing)
    except (OSError, ValueError, KeyError, TypeError) as e:  # damaged files: said, not waited on
        why = f"no summary: its telemetry could not be read ({type(e).__name__}: {e})"
        return {"mode": "none", "num_samples": 0, "duration_s": 0.0,
                "sample_cost_ms": {"mean": None, "max": None}, "gpus": [], "ranks": [], "nodes": [],
                "flags": [], "notes": [why]}


def peak_bytes(memory: dict[str, Any] | None) -> int | None:
    """The highest peak of the job: over its GPUs, or over its ranks' RSS on CPU."""
    if not memory:
        return None
    peaks = [g.get("peak_used_bytes") or 0 for g in memory.get("gpus", [])] or \
        [r.get("peak_rss_bytes") or 0 for r in memory.get("ranks", [])]
    return max(peaks) if peaks else None

