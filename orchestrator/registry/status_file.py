"""What tasks write instead of touching the database: one attempt's own report, a small file in
its run directory (:class:`TaskStatus`). Written on the nodes; the registry is never opened there.

Also read here, from the attempt's submitit log folder: whether its ranks left on a stop request
(each rank's ``JOBID_RANK_result.stopped``, written after the checkpoint) and where rank 0 said
it stopped (``stopped by PREEMPTED at step 676; checkpoint in DIR``, the last such line of its log)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from durable import atomic


@dataclass(frozen=True)
class TaskStatus:
    """One attempt's own report, written by its rank 0 into RUN/.switchyard/attempts/JOBID.json.

    Written when the task starts (again after each requeue) and when it ends; the file is replaced
    atomically, so a reader sees the old report or the new one, never half of one.
    """

    job_id: str
    started_at: float
    restarts: int = 0  # SLURM_RESTART_COUNT: 0 on the first run
    node: str | None = None
    ended_at: float | None = None
    exit_code: int | None = None  # 0: the task function returned; 1: it raised; else sys.exit code
    error: str | None = None  # the exception, one line

    @staticmethod
    def path(run_dir: str | Path, job_id: str) -> Path:
        return Path(run_dir) / ".switchyard" / "attempts" / f"{job_id}.json"

    def write(self, run_dir: str | Path) -> None:
        # No directory fsync: the next start or end rewrites it, and SLURM has the state anyway.
        atomic.write_json(self.path(run_dir, self.job_id), self.__dict__, durable=False)

    @classmethod
    def read(cls, run_dir: str | Path, job_id: str) -> TaskStatus | None:
        # os.path, not pathlib: reconciliation reads one per unsettled attempt, thousands per call
        path = os.path.join(run_dir, ".switchyard", "attempts", f"{job_id}.json")
        try:
            with open(path, "rb") as f:
                return cls(**json.loads(f.read()))
        except (OSError, ValueError, TypeError):
            return None


def where_stopped(log_dir: str, job_id: str) -> str | None:
    """Where a stopped attempt stopped, as its rank 0's log says (the trainer's ``stopped by
    PREEMPTED at step 676; checkpoint in RUN/checkpoints``); None when it says nothing."""
    try:
        with open(os.path.join(log_dir, f"{job_id}_0_log.out"), "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 16384, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in reversed(lines) if "stopped by " in line), None)


def stopped_cleanly(log_dir: str | None, job_id: str) -> str | None:
    """Where the attempt stopped, when every one of its ranks left on a stop request (a stop file
    for each rank that has a log); None when one did not, or nothing says. One listing."""
    if not log_dir:
        return None
    try:
        names = os.listdir(log_dir)
    except OSError:
        return None
    prefix = f"{job_id}_"
    mine = [n[len(prefix):] for n in names if n.startswith(prefix)]
    ranks = {n.removesuffix("_log.out") for n in mine if n.endswith("_log.out")}
    stopped = {n.removesuffix("_result.stopped") for n in mine if n.endswith("_result.stopped")}
    if not ranks or not ranks <= stopped:
        return None
    try:
        with open(os.path.join(log_dir, f"{job_id}_0_result.stopped")) as f:
            reason = f.read().strip() or "a stop request"
    except OSError:
        reason = "a stop request"
    return where_stopped(log_dir, job_id) or f"its {len(ranks)} rank(s) stopped on {reason}"
