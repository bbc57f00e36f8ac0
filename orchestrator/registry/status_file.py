"""What tasks write instead of touching the database: one attempt's own report, a small file in
its run directory (:class:`TaskStatus`). Written on the nodes; the registry is never opened there."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator import atomic


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
