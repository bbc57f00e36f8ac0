"""switchyard.submit on the two-node cluster: each rank's result, and submitit's checkpoint()
protocol kept: the callable is checkpointed on SIGUSR2, requeued, and resumes from its state."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_helpers import CANCEL_AFTER_RESULT_PROGRAM, CHECKPOINTABLE_PROGRAM, FUNCTION_PROGRAM
from slurm_helpers import release_requeue_hold

pytestmark = pytest.mark.slurm

TWO_NODES = ["cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=2"]


def start(tmp_path: Path, program: str, *overrides: str) -> tuple[subprocess.Popen[str], Path]:
    (tmp_path / "program.py").write_text(program)
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "program.py", str(run_dir), *overrides], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    return process, run_dir


def job_id_from(process: subprocess.Popen[str], queued: list[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"job_id (\S+)", line)
    assert match is not None, line + (process.stderr.read() if process.stderr else "")
    queued.append(match.group(1))
    return match.group(1)


def results_of(stdout: str) -> list[dict]:  # type: ignore[type-arg]
    line = next(line for line in stdout.splitlines() if line.startswith("results "))
    return json.loads(line.removeprefix("results "))  # type: ignore[no-any-return]


def test_a_submitted_function_returns_each_ranks_result(tmp_path: Path, queued: list[str]) -> None:
    process, run_dir = start(tmp_path, FUNCTION_PROGRAM, *TWO_NODES)
    job_id_from(process, queued)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    results = results_of(stdout)
    assert [(r["rank"], r["local_rank"], r["world"], r["sum"]) for r in results] == \
        [(0, 0, 4, 20.0), (1, 1, 4, 20.0), (2, 0, 4, 20.0), (3, 1, 4, 20.0)]
    assert "status COMPLETED" in stdout
    assert {p.name for p in (run_dir / "telemetry").glob("*.jsonl")} == {"n1.jsonl", "n2.jsonl"}


def test_cancel_after_result_leaves_a_completed_job_completed(tmp_path: Path, queued: list[str]) -> None:
    """Job.cancel() after result() scancelled the job SLURM was still completing (sacct:
    CANCELLED+) and recorded it CANCELLED; it now shares `switchyard cancel`'s check for an end."""
    from orchestrator.launch import slurm_query

    process, _ = start(tmp_path, CANCEL_AFTER_RESULT_PROGRAM, "cluster=slurm")
    job_id = job_id_from(process, queued)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert "results [9, 9]" in stdout and "status COMPLETED" in stdout, stdout + stderr[-2000:]
    assert slurm_query.wait_for_terminal_states([job_id], timeout_s=60)[job_id] == "COMPLETED"


def test_a_checkpoint_protocol_callable_is_requeued_and_resumes(tmp_path: Path, queued: list[str]) -> None:
    process, run_dir = start(tmp_path, CHECKPOINTABLE_PROGRAM, *TWO_NODES)
    job_id = job_id_from(process, queued)
    deadline = time.monotonic() + 180
    while not ((run_dir / "progress").exists() and int((run_dir / "progress").read_text() or 0) >= 20):
        assert time.monotonic() < deadline, "the function never reached step 20"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    release_requeue_hold(job_id)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    results = results_of(stdout)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["restart"] == 1 and r["started_at"] >= 20 for r in results), results
    logs = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.out"))
    assert "checkpoint at step" in logs
