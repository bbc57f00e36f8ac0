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

import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator import atomic
from orchestrator.sweeps.registry import Job, Observation, Registry, Submitted

POINT_DIR = ".switchyard"  # as a sweep point's: RUN/.switchyard/config.yaml
SINGLE_NUM = 0  # the one job of a single job's "sweep"


@dataclass(frozen=True)
class Recorded:
    """Where a single job sits in the registry."""

    registry: Path
    sweep_id: int
    attempt_id: int

    @property
    def ref(self) -> str:
        return f"{self.sweep_id}/{SINGLE_NUM}"


def record(app: str, command: str, run_dir: Path, executor: str, job_id: str, log_dir: Path,
           overrides: list[str], config_yaml: str, registry_path: str | Path | None = None) -> Recorded:
    """Record one submitted job (``executor``: slurm | local) as a sweep of one, already confirmed;
    its resolved config goes where ``switchyard show`` reads a sweep job's."""
    atomic.write_text(Path(run_dir) / POINT_DIR / "config.yaml", config_yaml)
    with Registry(registry_path) as registry:
        sweep_id = registry.create_sweep(app=app, command=command, sweep_dir=str(run_dir),
                                         executor=executor, entry_path="")
        registry.add_jobs([Job(sweep_id, SINGLE_NUM, overrides, str(run_dir), {}, None)])
        attempt_id = registry.claim(sweep_id, [SINGLE_NUM])[SINGLE_NUM]
        array_id, _, index = job_id.partition("_")
        registry.confirm([Submitted(attempt_id, job_id, array_id if index else None,
                                    int(index) if index else None, str(log_dir))])
        return Recorded(registry.path, sweep_id, attempt_id)


def finish(recorded: Recorded, state: str, exit_code: int | None, error: str | None = None) -> None:
    """The submitting side saw the job end (a blocking run): record it now, so ``status`` is right
    even for a job whose ranks wrote no status file."""
    with Registry(recorded.registry) as registry:
        registry.observe([Observation(recorded.attempt_id, state, ended_at=time.time(),
                                      exit_code=exit_code, error=error[-2000:] if error else None)])


def is_single(entry_path: str) -> bool:
    return entry_path == ""
