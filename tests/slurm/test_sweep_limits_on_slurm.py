"""Sweeps against SLURM's limits on the real local cluster: more points than MaxArraySize go out as
several arrays that all run; more jobs than MaxJobCount leaves room for are refused with nothing
queued. The cluster's limits (1001 and 10000) are far above what a test can submit, so scontrol
reports small ones here (tests/slurm_fakes.py: everything else is the real scontrol, sbatch and
the real jobs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sweep_probe
from slurm_fakes import limiting_scontrol

pytestmark = pytest.mark.slurm

SWITCHYARD = shutil.which("switchyard", path=str(Path(sys.executable).parent)) or "switchyard"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")


@pytest.fixture
def job_name(tmp_path: Path) -> Iterator[str]:
    """The sweep's SLURM job name; whatever still runs under it is cancelled when the test ends."""
    name = f"sy-limits-{os.getpid()}-{tmp_path.name}"[:60]
    yield name
    subprocess.run(["scancel", "--name", name], capture_output=True, check=False, timeout=60)


def env_for(tmp_path: Path, **limits: int) -> dict[str, str]:
    env = sweep_probe.registry_env(tmp_path)
    bin_dir = limiting_scontrol(tmp_path / "bin", **limits)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}


def run(tmp_path: Path, env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def status(tmp_path: Path, env: dict[str, str], sweep: str) -> dict[str, dict[str, object]]:
    proc = run(tmp_path, env, SWITCHYARD, "status", sweep, "--json")
    assert proc.returncode == 0, proc.stderr
    return {job["job"]: job for job in json.loads(proc.stdout)["jobs"]}


def test_more_points_than_max_array_size_run_as_two_arrays(tmp_path: Path, job_name: str) -> None:
    sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label="split",
                          launcher_settings={"timeout_min": 2, "job_name": job_name})
    env = env_for(tmp_path, MaxArraySize=3)
    proc = run(tmp_path, env, sys.executable, str(tmp_path / "app.py"), "-m", "x=1,2,3,4,5",
               "hydra.launcher.wait=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "5 jobs submitted in 2 submission(s)" in proc.stdout
    sweep = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("sweep_id: "))
    deadline = time.monotonic() + 180
    jobs = status(tmp_path, env, sweep)
    while any(job["state"] not in ENDED for job in jobs.values()):
        assert time.monotonic() < deadline, jobs
        time.sleep(1)
        jobs = status(tmp_path, env, sweep)
    assert [job["state"] for job in jobs.values()] == ["COMPLETED"] * 5, jobs
    arrays = [str(job["slurm_id"]).split("_") for job in jobs.values()]
    assert [index for _, index in arrays] == ["0", "1", "2", "0", "1"]  # 3 + 2: indices below 3
    assert len({array for array, _ in arrays}) == 2
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "out").glob("ran-*")) == ["1", "2", "3", "4", "5"]


@pytest.mark.queues_nothing
def test_a_sweep_past_max_job_count_is_refused_and_queues_nothing(tmp_path: Path, job_name: str) -> None:
    sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label="full",
                          launcher_settings={"timeout_min": 2, "job_name": job_name})
    env = env_for(tmp_path, MaxJobCount=2)
    proc = run(tmp_path, env, sys.executable, str(tmp_path / "app.py"), "-m", "x=1,2,3",
               "hydra.launcher.wait=false")
    assert proc.returncode != 0
    for part in ("3 jobs do not fit in SLURM: MaxJobCount=2", "nothing was queued",
                 "hydra.launcher.array_parallelism"):
        assert part in proc.stderr, proc.stderr[-3000:]
    queued = subprocess.run(["squeue", "-h", "-n", job_name], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    assert queued.strip() == ""
    listed = run(tmp_path, env, SWITCHYARD, "status", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["sweeps"] == []
    assert not list((tmp_path / "out").glob("ran-*"))
