"""A queued SLURM job holds its run directory before its rank 0 takes the lock: a second
submission naming it is refused before it is submitted, naming both runs; once the first has
ended, the same hydra.run.dir continues it (``orchestrator.launch.ownership``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def switchyard_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})


def test_a_pending_jobs_directory_is_refused_to_a_second_submission(tmp_path: Path, queued: list[str]
                                                                     ) -> None:
    """Before, the second of two cluster.wait=false submissions into one directory queued, then
    failed on the lock (or resumed the first's checkpoint) when it started."""
    run_dir = tmp_path / "run"
    held = ("cluster=slurm", "cluster.wait=false", "cluster.sbatch_args=[\"--begin=now+3600\"]",
            "cluster.snapshot.enabled=false", f"hydra.run.dir={run_dir}")
    first = switchyard_run(tmp_path, *held, "parallelism.procs_per_node=1", "--", "true")
    assert first.returncode == 0, first.stderr[-2000:]
    job_id = re.search(r"slurm_job_id: (\S+)", first.stdout).group(1)  # type: ignore[union-attr]
    queued.append(job_id)
    second = switchyard_run(tmp_path, *held, "parallelism.procs_per_node=2", "--", "true")
    if queued_too := re.search(r"slurm_job_id: (\S+)", second.stdout):  # the old code's: cancelled too
        queued.append(queued_too.group(1))
    assert second.returncode == 2, second.stderr[-2000:]
    refused = (rf"switchyard run: error: hydra.run.dir='{run_dir}' is in use by switchyard job 1/0 "
               rf"\(id {job_id}, [A-Z]+, submitted as `run [^`]*procs_per_node=1`\); "
               rf"this run, `run [^`]*procs_per_node=2` \(submitted .*\), would overwrite .*\n")
    assert re.fullmatch(refused, second.stderr), second.stderr
    assert queued_too is None, "the second submission was queued"
    subprocess.run(["scancel", job_id], check=True)
    again = switchyard_run(tmp_path, "cluster=local", f"hydra.run.dir={run_dir}",
                           "parallelism.procs_per_node=1", "--", "true")  # it ended: its directory goes on
    assert again.returncode == 0, again.stderr[-2000:]
