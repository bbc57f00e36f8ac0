"""Single jobs in the registry: a ``jobs.train`` run, a ``switchyard run`` command or a submitted
function is recorded as a sweep of one job, so ``switchyard status``, ``show``, ``logs`` and
``cancel`` know it by its id (or its SLURM id / local pid) like any sweep's job.

Only what the submitting side knows goes in: the job's run directory, its command line, its
submitit log folder and the id SLURM (or the local executor) gave it. State comes, as for sweeps,
from SLURM and from the status file rank 0 writes (``TaskStatus``) where the job writes one.
A single job has no saved sweep entry (``entry_path`` is empty): ``resubmit`` refuses it and
names the command to run instead.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import submitit
from submitit.local.local import LocalJob

from durable import atomic
from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import local_jobs, ownership, progress, provenance, submit
from orchestrator.registry.db import (
    SINGLE_ENTRY,
    SINGLE_NUM,
    Job,
    Observation,
    Registry,
    RegistryError,
    Submitted,
)
from orchestrator.registry.status_file import TaskStatus

R = TypeVar("R")

POINT_DIR = ".switchyard"  # as a sweep point's: RUN/.switchyard/config.yaml


@dataclass(frozen=True)
class Recorded:
    """Where a single job sits in the registry."""

    registry: Path
    sweep_id: int
    attempt_id: int
    run_dir: Path
    job_id: str
    num: int = SINGLE_NUM

    @property
    def ref(self) -> str:
        return f"{self.sweep_id}/{self.num}"


@dataclass(frozen=True)
class Into:
    """Record a job as job ``num`` of an existing sweep (a search's trial), not as a sweep of one."""

    registry: Path
    sweep_id: int
    num: int
    total_steps: int | None = None  # the job's progress bar in `switchyard status`


def shape(parallelism: ParallelismConfig) -> dict[str, Any]:
    """What a single job records of its ranks, in the form a sweep job's resources take
    (``status.num_ranks`` reads it): ``logs --rank 7`` of a 4-rank job is refused, not shown as a
    log not written yet."""
    return {"params": {"nodes": parallelism.nodes, "tasks_per_node": parallelism.tasks_per_node}}


def record(app: str, command: str, run_dir: Path, executor: str, job_id: str, log_dir: Path,
           overrides: list[str], config_yaml: str, registry_path: str | Path | None = None,
           resources: dict[str, Any] | None = None, total_steps: int | None = None,
           into: Into | None = None) -> Recorded:
    """Record one submitted job (``executor``: slurm | local) as a sweep of one (or as ``into``'s
    job: a search's trial), already confirmed; its resolved config goes where ``switchyard show``
    reads a sweep job's. ``resources``: its :func:`shape`; ``total_steps``: the steps it trains
    (``status`` shows STEP as step/total)."""
    atomic.write_text(Path(run_dir) / POINT_DIR / "config.yaml", config_yaml)
    with Registry(into.registry if into else registry_path) as registry:
        if into is None:
            sweep_id = registry.create_sweep(app=app, command=command, sweep_dir=str(run_dir),
                                             executor=executor, entry_path=SINGLE_ENTRY)
            num = SINGLE_NUM
        else:
            sweep_id, num, total_steps = into.sweep_id, into.num, into.total_steps
        registry.add_jobs([Job(sweep_id, num, overrides, str(run_dir), resources or {}, total_steps)])
        if (origin := provenance.read(run_dir)) is not None:  # written at submission (at_submission)
            registry.record_provenance(sweep_id, {num: origin})
        attempt_id = registry.claim(sweep_id, [num])[num]
        array_id, _, index = job_id.partition("_")
        registry.confirm([Submitted(attempt_id, job_id, array_id if index else None,
                                    int(index) if index else None, str(log_dir))])
        # the registry says from now on whether the run is live, not the submitting process
        ownership.record_job(Path(run_dir), registry.path, sweep_id, num, job_id)
        return Recorded(registry.path, sweep_id, attempt_id, Path(run_dir), job_id, num)


def run_reporting(run_dir: str | Path, job_id: str, restarts: int, node: str, is_main: bool,
                  run: Callable[[], R]) -> R:
    """Run one rank of a single job; rank 0 writes the attempt's status file (node, start, then end
    and exit code) for ``switchyard status`` and ``show``, as ``switchyard run`` ranks and sweep
    points do: a ``jobs.train`` job's NODE, STARTED and RUNTIME were empty. A stop for a requeue or
    preemption (a SystemExit with a ``stop_reason``: the trainer's JobStopped, AttemptNotOver)
    writes no end: the attempt is not over."""
    if not is_main:
        return run()
    status = TaskStatus(job_id=job_id, started_at=time.time(), restarts=restarts, node=node)
    status.write(run_dir)
    try:
        result = run()
    except SystemExit as e:
        if not hasattr(e, "stop_reason"):
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            _end(status, run_dir, code, f"exited with status {code}" if code else None)
        raise
    except BaseException as e:
        _end(status, run_dir, 1, f"{type(e).__name__}: {e}".splitlines()[0][:500])
        raise
    _end(status, run_dir, 0, None)
    return result


def _end(status: TaskStatus, run_dir: str | Path, code: int, error: str | None) -> None:
    TaskStatus(**{**status.__dict__, "ended_at": time.time(), "exit_code": code,
                  "error": error}).write(run_dir)


def record_submitted(app: str, command: str, job: submitit.Job[Any], run_dir: Path, overrides: list[str],
                     config_yaml: str, parallelism: ParallelismConfig, announce: bool = True,
                     total_steps: int | None = None, into: Into | None = None) -> Recorded | None:
    """``record`` for a job just queued with ``parallelism``'s ranks (``announce``: print its id;
    ``into``: recorded as that sweep's job); a registry that cannot take it is a warning, not an
    error: the job runs anyway, and says so. A debug job (this process, no scheduler) is not
    recorded: None."""
    if isinstance(job, submitit.DebugJob):
        return None
    executor = "local" if isinstance(job, LocalJob) else "slurm"
    try:
        recorded = record(app, command, run_dir, executor, str(job.job_id), Path(job.paths.folder),
                          overrides, config_yaml, resources=shape(parallelism), total_steps=total_steps,
                          into=into)
    except (RegistryError, sqlite3.Error, OSError) as e:
        print(f"warning: job {job.job_id} runs, but the registry did not record it: {e}", file=sys.stderr)
        return None
    if announce:
        print(f"job: {recorded.ref} (switchyard status {recorded.ref})", flush=True)
    return recorded


CONTROLLER_LOG = "controller.log"  # RUN/submitit/: a not-waited-for local job's controller output


def submitting(cluster: ClusterConfig, run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Around a single job's submission. A local job not waited for (``cluster.wait=false``) runs
    on in the background once this process has returned, so its controller must not hold this
    process's stdout and stderr: a caller reading them through a pipe (``$(...)``, ``| tee``, a
    CI step) would wait for the job's end. Its output goes to ``RUN/submitit/controller.log``."""
    if cluster.mode == "local" and not cluster.wait:
        return local_jobs.detached_output(run_dir / "submitit" / CONTROLLER_LOG)
    return contextlib.nullcontext()


def follow(cluster: ClusterConfig, recorded: Recorded | None, job: submitit.Job[R], run_dir: Path,
           total_steps: int | None = None) -> list[R] | None:
    """After a single job's submission: on SLURM say where it is, then (unless
    ``cluster.wait=false``: None, saying how to follow and stop it) watch it while it pends and
    return every rank's result. While it waits, stderr shows the queue state, then rank 0's
    progress (``progress``: of ``total_steps`` where the job has a known length)."""
    if cluster.mode == "slurm":
        print(f"slurm_job_id: {job.job_id}\nlogs: {job.paths.folder}", flush=True)
    if cluster.mode == "debug":  # it runs here, as results() asks for it: its own bar is on stderr
        return results(recorded, job, run_dir, cluster.restarts)
    if not cluster.wait:
        print(not_waiting(cluster, recorded, job), flush=True)
        return None
    display = progress.Display()
    try:
        if cluster.mode == "slurm":
            submit.watch_pending(job, cluster.never_starts, on_wait=display.pending)
        with progress.following(run_dir, total_steps, display):
            return results(recorded, job, run_dir, cluster.restarts)
    finally:
        display.clear()


def not_waiting(cluster: ClusterConfig, recorded: Recorded | None, job: submitit.Job[Any]) -> str:
    """How to follow and stop a job this process does not wait for."""
    if recorded is not None:
        ref = recorded.ref
        return (f"not waiting (cluster.wait=false): follow it with switchyard status {ref} "
                f"(rank 0's log: switchyard logs {ref}); stop it with switchyard cancel {ref}")
    if cluster.mode == "slurm":
        return f"not waiting (cluster.wait=false): follow it with squeue -j {job.job_id}"
    return (f"not waiting (cluster.wait=false): it runs on in the background as process {job.job_id} "
            f"(logs: {job.paths.folder}); stop it with kill {job.job_id}")


def results(recorded: Recorded | None, job: submitit.Job[R], run_dir: Path, restarts: int = 0) -> list[R]:
    """``submit.results``, and the end it saw recorded in the registry."""
    try:
        values = submit.results(job, run_dir, restarts)
    except submit.JobStoppedError as e:  # cancelled, not failed: where it stopped, its checkpoint
        if recorded is not None:
            finish(recorded, e.state, None, str(e))
        raise
    except submit.JobFailedError as e:
        if recorded is not None:  # "job N failed (FAILED): rank 1 on node n2: ... killed by SIGKILL"
            finish(recorded, "FAILED", 1, " ".join(str(e).splitlines()[:2]))
        raise
    if recorded is not None:
        finish(recorded, "COMPLETED", 0)
    return values


def finish(recorded: Recorded, state: str, exit_code: int | None, error: str | None = None) -> None:
    """The submitting side saw the job end (a blocking run): record it now, so ``status`` is right
    even for a job whose ranks wrote no status file (what rank 0 wrote, if anything, is kept)."""
    status = TaskStatus.read(recorded.run_dir, recorded.job_id)
    if state == "FAILED" and status is not None and status.ended_at is not None and status.exit_code:
        exit_code = status.exit_code  # rank 0's: the failing command's own status (137: SIGKILL)
    with Registry(recorded.registry) as registry:
        registry.observe([Observation(recorded.attempt_id, state, requeues=status.restarts if status else 0,
                                      started_at=status.started_at if status else None,
                                      node=status.node if status else None, ended_at=time.time(),
                                      exit_code=exit_code, error=error[-2000:] if error else None)])
