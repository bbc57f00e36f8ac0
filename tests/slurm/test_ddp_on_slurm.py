"""End to end on the real local cluster: submitit -> sbatch -> srun -> 4 gloo ranks on 2 nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jobs import smoke
from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import slurm_query, submit

pytestmark = pytest.mark.slurm


def executor(tmp_path: Path):  # type: ignore[no-untyped-def]
    return submit.make_executor(ClusterConfig(mode="slurm", timeout_min=10),
                                ParallelismConfig(nodes=2, procs_per_node=2), tmp_path / "jobs")


def test_two_nodes_two_tasks_all_reduce(tmp_path: Path) -> None:
    job = submit.submit(executor(tmp_path), smoke.allreduce, str(tmp_path / "rdzv"))
    results = submit.results(job)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["reduced"] == 10.0 and r["world_size"] == 4 for r in results)
    assert {r["hostname"] for r in results} == {"n1", "n2"}
    assert sorted((r["node_rank"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert slurm_query.wait_for_terminal_states([job.job_id]) == {job.job_id: "COMPLETED"}


def test_failing_rank_is_reported_with_its_error(tmp_path: Path) -> None:
    job = submit.submit(executor(tmp_path), smoke.allreduce, str(tmp_path / "rdzv"), fail_on_rank=2)
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    message = str(info.value)
    assert info.value.failed_ranks == [2]
    assert "rank 2 on node n2" in message
    assert "deliberate failure on rank 2" in message
    assert slurm_query.wait_for_terminal_states([job.job_id])[job.job_id] == "FAILED"


@pytest.mark.cycles_cluster
def test_cluster_up_is_idempotent_and_down_up_cycles() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", "cluster", *args],
                              capture_output=True, text=True, timeout=300)

    assert cli("up").returncode == 0  # already up: harmless
    assert cli("status").returncode == 0
    # The test before this one ends when sacct says FAILED, while its job may still be COMPLETING:
    # the controller would bring that job back after the cycle, its nodes alloc instead of idle.
    assert wait_until(squeue_empty, 120), "jobs still in the queue before the cycle"
    down = cli("down")
    assert down.returncode == 0 and "slurmctld" in down.stdout
    stopped = cli("status")
    assert stopped.returncode == 3 and "slurmctld    stopped" in stopped.stdout
    up = cli("up")
    assert up.returncode == 0, up.stderr
    assert "n1 debug* " in up.stdout and "n2 debug* " in up.stdout
    assert wait_until(lambda: node_states() == {"n1": "idle", "n2": "idle"}, 60), node_states()


def wait_until(ready: Callable[[], bool], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def squeue_empty() -> bool:
    proc = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and not proc.stdout.strip()


def node_states() -> dict[str, str]:
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    return dict(line.split() for line in proc.stdout.splitlines() if line.strip())
