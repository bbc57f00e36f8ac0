"""A single local jobs.train run enters the registry like a sweep of one job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from train_helpers import run_train


def test_a_single_local_train_run_is_in_switchyard_status(tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    run_dir = tmp_path / "run"
    proc = run_train("optim.max_steps=4", "log_every_steps=2", "data.demo_num_samples=256",
                     cache_dir=tmp_path / "cache", run_dir=run_dir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job: 1/0" in proc.stdout
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    listed = json.loads(status.stdout)
    (job,) = listed["jobs"]
    assert listed["sweep"]["app"] == "train" and listed["sweep"]["executor"] == "local"
    assert job["state"] == "COMPLETED" and job["run_dir"] == str(run_dir) and job["step"] == 4
    assert job["total_steps"] == 4  # STEP was 4, not 4/4 as a sweep's job shows it
    table = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert table.splitlines()[-1].split()[6] == "4/4", table
    # NODE, STARTED and RUNTIME were empty: only `switchyard run` ranks wrote the attempt's file
    assert job["node"] == socket.gethostname() and job["exit_code"] == 0
    assert job["started_at"] <= job["ended_at"] and job["runtime_s"] == job["ended_at"] - job["started_at"]
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", "1/0"], env=env,
                           capture_output=True, text=True, check=True)
    assert "max_steps: 4" in shown.stdout


def test_a_debug_run_is_not_recorded(tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = run_train("cluster=debug", "optim.max_steps=2", "log_every_steps=1", "data.demo_num_samples=256",
                     cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status"], env=env,
                            capture_output=True, text=True, check=True)
    assert "no sweeps recorded" in status.stdout
