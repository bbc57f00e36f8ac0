"""Restarts inside the allocation (``cluster.restarts``, ``orchestrator/launch/restarts.py``) on the
real local cluster: a killed rank's job starts again in the same job, from its newest checkpoint,
and ends as an uninterrupted run ends; the code's own bug, twice in a row, ends the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from train_helpers import run_train, train_command

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

TESTS = str(Path(__file__).resolve().parents[1])  # model_helpers, for the ranks
COMMON = ["cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=1", "optim.max_steps=300",
          "data.demo_num_samples=512", "data.batch_size=16", "checkpoint.every_steps=10",
          "log_every_steps=10",
          "deterministic=true", "telemetry.enabled=false", "memory.estimate=off", "logger.tensorboard=false",
          "cluster.collective_timeout_s=5"]  # a heartbeat every 0.5 s: the test sees the step early


def _pid_at_step(heartbeat: Path, step: int, proc: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            record = json.loads(heartbeat.read_text())
            if record["step"] >= step:
                return int(record["pid"])
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"rank 1 never reached step {step} (exit {proc.poll()})")


def test_a_killed_rank_restarts_inside_the_allocation_and_ends_as_an_uninterrupted_run(
        tmp_path: Path, queued: list[str]) -> None:
    reference = run_train(*COMMON, "cluster.wait=false", cache_dir=tmp_path / "cache",
                          run_dir=tmp_path / "reference", timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    queued.append(re.search(r"slurm_job_id: (\S+)", reference.stdout).group(1))  # type: ignore[union-attr]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_command(*COMMON, "cluster.restarts=1", cache_dir=tmp_path / "cache",
                                          run_dir=run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        os.kill(_pid_at_step(run_dir / "heartbeat" / "rank-1.json", 15, proc), signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
        for submitted in (run_dir / "submitit").glob("*_submitted.pkl"):
            queued.append(submitted.name.split("_")[0])
    assert proc.returncode == 0, err[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", out).group(1)  # type: ignore[union-attr]
    batch_log = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert "the step failed" in batch_log and "restart 1/1 inside allocation" in batch_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 15 <= summary["resumed_from"]["step"] < 300  # it trained on after the restart
    assert summary["restarts_in_allocation"] == 1 and summary["restart_to_first_step_s"] > 0
    assert slurm_query.wait_for_terminal_states([queued[0]], timeout_s=300)[queued[0]] == "COMPLETED"
    uninterrupted = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["param_checksum_per_rank"] == uninterrupted["param_checksum_per_rank"]
    assert summary["final_train_loss"] == uninterrupted["final_train_loss"]
    assert summary["samples_per_rank"] == uninterrupted["samples_per_rank"]


def test_the_same_failure_twice_in_a_row_ends_the_job(tmp_path: Path, queued: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = run_train(*COMMON, "cluster.restarts=3", "model=custom",
                     "model._target_=model_helpers.FailsOnRank1", cache_dir=tmp_path / "cache",
                     run_dir=run_dir, timeout=400,
                     env={"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    for submitted in (run_dir / "submitit").glob("*_submitted.pkl"):
        queued.append(submitted.name.split("_")[0])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ValueError: the model's own bug" in proc.stderr
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    batch_log = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert batch_log.count("restart 1/3 inside allocation") == 1 and "restart 2/3" not in batch_log
    assert "the same failure twice in a row" in batch_log
