"""``cluster.wait=false`` under ``cluster=local`` for a single job (``switchyard run``, ``jobs.train``):
the submitter returns once the job has started, saying how to follow and stop it, and the job runs
on in the background, recorded in the registry (issue 53: both blocked until the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from train_helpers import CHEAP, train_command

# Each rank waits for the test to let it finish: a job that is still running when its submitter
# has returned proves the submitter did not wait for it.
WAITING_SCRIPT = """
import os, sys, time
from pathlib import Path
release = Path(sys.argv[1])
while not release.exists():
    time.sleep(0.05)
print("rank", os.environ["RANK"], "released", flush=True)
"""


def registry_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}


def cli(tmp_path: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run through pipes, as ``$(...)`` or a CI step would: a controller holding them would block."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path,
                          env=registry_env(tmp_path), capture_output=True, text=True, timeout=timeout_s)


def job_status(tmp_path: Path) -> dict[str, Any]:
    proc = cli(tmp_path, "status", "1/0", "--json")
    assert proc.returncode == 0, proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    return dict(job)


def wait_for_state(tmp_path: Path, states: set[str], timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (job := job_status(tmp_path))["state"] not in states:
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    return job


def test_switchyard_run_returns_and_the_local_job_runs_on(tmp_path: Path) -> None:
    (tmp_path / "wait.py").write_text(WAITING_SCRIPT)
    release, run_dir = tmp_path / "release", tmp_path / "run"
    try:
        proc = cli(tmp_path, "run", "cluster.wait=false", f"hydra.run.dir={run_dir}", "--",
                   sys.executable, "wait.py", str(release))
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert lines[0] == f"run_dir: {run_dir}"
        assert lines[-1] == ("not waiting (cluster.wait=false): follow it with switchyard status 1/0 "
                             "(rank 0's log: switchyard logs 1/0); stop it with switchyard cancel 1/0")
        assert job_status(tmp_path)["state"] in {"PENDING", "RUNNING"}  # not ended: nobody let it
        release.touch()
        job = wait_for_state(tmp_path, {"COMPLETED", "FAILED", "CANCELLED"})
        assert job["state"] == "COMPLETED", job
        logs = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_log.out"))
        assert "rank 0 released" in logs and "rank 1 released" in logs
    finally:
        release.touch()


def test_a_local_training_job_not_waited_for_runs_on_until_cancelled(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = train_command(*CHEAP, "cluster.wait=false", "optim.max_steps=1000000", "log_every_steps=1",
                            "data.demo_num_samples=256", "data.batch_size=16", run_dir=run_dir,
                            cache_dir=tmp_path.parent / "demo-cache")
    try:
        proc = subprocess.run(command, env=registry_env(tmp_path), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines()[0] == f"run_dir: {run_dir}"
        assert "stop it with switchyard cancel 1/0" in proc.stdout.splitlines()[-1]
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists():  # it trains after its submitter has returned
            assert time.monotonic() < deadline, job_status(tmp_path)
            time.sleep(0.2)
        assert job_status(tmp_path)["state"] == "RUNNING"
    finally:
        cancel = cli(tmp_path, "cancel", "1", "--grace", "30")
    assert "cancelled 1 job(s)" in cancel.stdout, cancel.stdout + cancel.stderr
    assert job_status(tmp_path)["state"] == "CANCELLED"
