"""A sweep point's job on the node: every task loads the point's saved config and runs Hydra's
``run_job`` with the task function (:func:`run_point`).

Points whose config has Switchyard's ``cluster`` and ``parallelism`` groups get
``nodes x tasks_per_node`` tasks and ``SWITCHYARD_IN_JOB=1``, so each task is one DDP rank; any
other Hydra app gets the launcher's own resources (one task by default). Rank 0 writes the
attempt's start and end (``TaskStatus``) and its ``JobReturn`` into the run directory, where the
submitting side and ``switchyard status`` read them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import open_dict, read_write

from durable import atomic
from orchestrator.launch import dist_env
from orchestrator.registry.status_file import TaskStatus

if TYPE_CHECKING:
    from hydra.core.utils import JobReturn

log = logging.getLogger(__name__)

POINT_DIR = ".switchyard"  # inside each point's run directory


class PointFailed(RuntimeError):
    """A point's task function raised (its exception is chained); the job ends FAILED in SLURM."""


def write_bytes(path: Path, data: bytes, durable: bool = False) -> None:
    """Whole or absent (durable.atomic). Submit-time files skip the directory fsync: if the
    submit host crashes, resubmitting writes them again."""
    with atomic.atomic_write(path, binary=True, durable=durable) as f:
        f.write(data)



def run_point(run_dir: str) -> JobReturn:
    """What every task of a point's job runs: the saved config, through Hydra's ``run_job``."""
    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    files = Path(run_dir) / POINT_DIR
    spec = json.loads((files / "point.json").read_text())
    task_function, hydra_context, singleton_state = cloudpickle.loads(Path(spec["entry"]).read_bytes())
    Singleton.set_state(singleton_state)
    setup_globals()
    config = cloudpickle.loads((files / "config.pkl").read_bytes())
    env = dist_env.detect()
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.job.id = env.job_id
        if env.rank != 0:
            config.hydra.output_subdir = None  # one copy of .hydra/, written by rank 0
    if spec["ddp"]:
        os.environ[dist_env.IN_JOB_ENV] = "1"  # jobs.train: train here, this task is one rank
    report = TaskStatus(job_id=env.job_id, started_at=time.time(), restarts=env.restart_count,
                        node=env.hostname)
    if env.is_main:
        report.write(run_dir)
    ret = _run_reporting(lambda: run_job(hydra_context=hydra_context, task_function=task_function,
                                         config=config, job_dir_key="hydra.sweep.dir",
                                         job_subdir_key="hydra.sweep.subdir"),
                         report, run_dir, env.is_main)
    if ret.status == JobStatus.FAILED:
        error = ret._return_value
        raise PointFailed(f"sweep point #{spec['num']} ({' '.join(spec['overrides'])}) failed: "
                          f"{type(error).__name__}: {error}") from error
    return ret


def _run_reporting(run: Callable[[], JobReturn], report: TaskStatus, run_dir: str,
                   is_main: bool) -> JobReturn:
    """Run, then (rank 0) save the JobReturn and the end report. A stop for requeue/preemption
    writes no end: the attempt is not over."""
    import cloudpickle
    from hydra.core.utils import JobStatus

    try:
        ret = run()
    except SystemExit as e:
        # The trainer's JobStopped and rank_env's AttemptNotOver are told by their stop_reason, as
        # submit's wrapper tells them: their modules import torch, which an app's task needs not.
        if getattr(e, "stop_reason", None):
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if is_main:
            _end(report, run_dir, code, f"exited with status {code}" if code else None)
        raise
    if is_main:
        failed = ret.status == JobStatus.FAILED
        try:
            write_bytes(result_path(run_dir, report.job_id), cloudpickle.dumps(ret), durable=True)
        except Exception as e:  # an unpicklable return value must not turn success into failure
            log.warning(f"could not save the job's return value: {e}")
        error = ret._return_value if failed else None
        code = getattr(error, "exit_code", 1) if failed else 0  # a command's own status (scripts.rank)
        _end(report, run_dir, code if isinstance(code, int) and code != 0 else int(failed),
             f"{type(error).__name__}: {error}".splitlines()[0][:500] if failed else None)
    return ret


def _end(report: TaskStatus, run_dir: str, code: int, error: str | None) -> None:
    TaskStatus(**{**report.__dict__, "ended_at": time.time(), "exit_code": code,
                  "error": error}).write(run_dir)


def result_path(run_dir: str | Path, job_id: str) -> Path:
    return Path(run_dir) / POINT_DIR / "results" / f"{job_id}.pkl"

