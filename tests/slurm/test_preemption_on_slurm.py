"""Preemption, requeue, exact resume and fail-fast on the real local cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from process_helpers import running
from slurm_helpers import release_requeue_hold
from train_helpers import run_train

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

# Deterministic and slow enough (transformer on 2 cores) to be signalled mid-run: each test signals
# at step 10 or 15, about 45 steps (2-4 s on this machine) before the end; the signal lands within
# 2 or 3 steps. Two ranks per node (4 ranks) where a test needs a node's second rank (the kill
# tests); the signal tests run one per node (ONE_PER_NODE, 2 ranks): signals, requeues and resumes
# still cross the two nodes, for about 0.7x the CPU of 4 ranks (tests/conftest.py holds each rank
# to one OpenMP thread).
LONG = ["cluster=slurm", "parallelism.nodes=2", "model=transformer", "optim.max_steps=60",
        "data.demo_num_samples=1024", "data.batch_size=32", "log_every_steps=1", "deterministic=true",
        "checkpoint.keep_last=3"]
ONE_PER_NODE = "parallelism.procs_per_node=1"


def train(tmp_path: Path, name: str, *overrides: str, timeout_s: float = 600
          ) -> subprocess.CompletedProcess[str]:
    return run_train(*LONG, *overrides, cache_dir=tmp_path / "cache", run_dir=tmp_path / name,
                     timeout=timeout_s)


def submit_without_waiting(tmp_path: Path, name: str, *overrides: str) -> str:
    proc = train(tmp_path, name, "cluster.wait=false", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]


def wait_for_step(run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} never reached step {step}")


def summary(run_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((run_dir / "summary.json").read_text())


def all_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_log.*")))


def signalled_beside_a_reference(tmp_path: Path, queued: list[str], *overrides: str
                                 ) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """A job signalled with USR2 at step 15 and requeued (data.num_workers=2, as on GPU nodes:
    SLURM signals the forked workers too), beside the same run without workers nor signal, both
    queued at once (the partition oversubscribes): (its summary, the reference's)."""
    reference = submit_without_waiting(tmp_path, "reference", ONE_PER_NODE, *overrides)
    queued.append(reference)
    run_dir = tmp_path / "run"
    job_id = submit_without_waiting(tmp_path, "run", ONE_PER_NODE, "data.num_workers=2", *overrides)
    queued.append(job_id)
    wait_for_step(run_dir, 15)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    release_requeue_hold(job_id)
    states = slurm_query.wait_for_terminal_states([job_id, reference], timeout_s=400)
    logs = all_logs(run_dir)
    assert states == {job_id: "COMPLETED", reference: "COMPLETED"}, logs[-3000:]
    assert "DataLoader worker" not in logs, logs[-3000:]
    assert f"requeueing job {job_id}" in logs, logs[-3000:]
    assert "resumed from" in logs, logs[-3000:]
    return summary(run_dir), summary(tmp_path / "reference")


def test_signalled_job_is_requeued_and_ends_bit_identical(tmp_path: Path, queued: list[str]) -> None:
    """Before: with data.num_workers=2 a worker died of SIGTERM and the trainer raised
    "DataLoader worker (pid N) is killed by signal: Terminated" with no checkpoint."""
    resumed, uninterrupted = signalled_beside_a_reference(tmp_path, queued)
    assert resumed["steps"] == uninterrupted["steps"] == 60
    # workers change nothing of the order: the reference ran with none
    assert resumed["param_checksum_per_rank"] == uninterrupted["param_checksum_per_rank"]
    assert resumed["samples_per_rank"] == uninterrupted["samples_per_rank"]


def test_requeue_cap_stops_cleanly(tmp_path: Path, queued: list[str]) -> None:
    run_dir = tmp_path / "run"
    job_id = submit_without_waiting(tmp_path, "run", ONE_PER_NODE, "cluster.max_requeues=0")
    queued.append(job_id)
    wait_for_step(run_dir, 10)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)
    assert states[job_id] == "FAILED"
    logs = all_logs(run_dir)
    assert "cluster.max_requeues=0" in logs and "RequeueLimitError" in logs
    assert list((run_dir / "checkpoints").glob("step-*.pt")), "the checkpoint must be written first"


def test_sigkill_of_one_rank_ends_the_job_fast_and_names_it(tmp_path: Path, queued: list[str]) -> None:
    run_dir = tmp_path / "run"
    job_id = submit_without_waiting(tmp_path, "run", "optim.max_steps=100000",
                                    "cluster.collective_timeout_s=900")
    queued.append(job_id)
    wait_for_step(run_dir, 5)
    banner = re.search(r"switchyard: rank 2/4 on node (\S+) .*pid (\d+)\)", all_logs(run_dir))
    assert banner is not None
    killed_at = time.monotonic()
    os.kill(int(banner.group(2)), signal.SIGKILL)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=120, poll_s=0.2)
    assert time.monotonic() - killed_at < 60
    assert states[job_id] == "FAILED"

    from submitit import SlurmJob

    from orchestrator.launch import submit

    job = SlurmJob(folder=run_dir / "submitit", job_id=job_id, tasks=tuple(range(4)))
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    assert info.value.failed_ranks == [2], str(info.value)
    assert f"rank 2 on node {banner.group(1)}" in str(info.value)


def test_sigkill_of_a_node_launcher_takes_its_ranks_and_names_them(tmp_path: Path, queued: list[str]) -> None:
    """The launcher forks node n2's ranks 2 and 3: killed outright, it says nothing, its ranks die
    with it (PR_SET_PDEATHSIG) instead of holding the node, and srun's line for it names both."""
    run_dir = tmp_path / "run"
    job_id = submit_without_waiting(tmp_path, "run", "optim.max_steps=100000",
                                    "cluster.collective_timeout_s=900")
    queued.append(job_id)
    wait_for_step(run_dir, 5)
    rank2 = (run_dir / "submitit" / f"{job_id}_2_log.out").read_text()
    launcher = re.search(r"forked from the node launcher \(pid (\d+)\)", rank2)
    banners = r"switchyard: rank [23]/4 on node n2 .*pid (\d+)\)"
    ranks = [int(p) for p in re.findall(banners, all_logs(run_dir))]
    assert launcher is not None and len(ranks) == 2, rank2[-3000:]
    killed_at = time.monotonic()
    os.kill(int(launcher.group(1)), signal.SIGKILL)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=120, poll_s=0.2)
    assert time.monotonic() - killed_at < 60
    assert states[job_id] == "FAILED"
    deadline = time.monotonic() + 10
    while [pid for pid in ranks if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if running(pid)]

    from submitit import SlurmJob

    from orchestrator.launch import submit

    job = SlurmJob(folder=run_dir / "submitit", job_id=job_id, tasks=tuple(range(4)))
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    assert info.value.failed_ranks == [2, 3], str(info.value)
    assert "rank 2 on node n2: srun reports the task killed" in str(info.value)


def test_a_signalled_fsdp_job_is_requeued_and_ends_bit_identical(tmp_path: Path, queued: list[str]) -> None:
    """fsdp under SLURM's time-limit signal: every rank writes its shard, rank 0 requeues, and the
    job resumed from the sharded checkpoint ends with the weights of a run never interrupted."""
    resumed, uninterrupted = signalled_beside_a_reference(
        tmp_path, queued, "parallelism.strategy=fsdp")
    assert ".dcp at step" in all_logs(tmp_path / "run")
    assert resumed["steps"] == uninterrupted["steps"] == 60
    assert resumed["param_checksum_per_rank"] == uninterrupted["param_checksum_per_rank"]
    assert resumed["samples_per_rank"] == uninterrupted["samples_per_rank"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_sigterm_with_dataloader_workers_stops_at_a_step_and_checkpoints(
        tmp_path: Path, queued: list[str], strategy: str) -> None:
    """data.num_workers=2, as on GPU nodes. SLURM signals every process of the step, the forked
    workers too. Before: a worker died of SIGTERM and the trainer raised "DataLoader worker (pid N)
    is killed by signal: Terminated" with no checkpoint, and sacct said FAILED. (USR2 with workers:
    the two bit-identical requeue tests above.)"""
    run_dir = tmp_path / "run"
    extra = ["parallelism.strategy=fsdp"] if strategy == "fsdp" else []
    job_id = submit_without_waiting(tmp_path, "run", ONE_PER_NODE, "data.num_workers=2", *extra)
    queued.append(job_id)
    wait_for_step(run_dir, 15)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    slurm_query.wait_for_terminal_states([job_id], timeout_s=400)
    logs = all_logs(run_dir)
    assert "DataLoader worker" not in logs, logs[-3000:]
    stop = re.search(r"stopped by PREEMPTED at step (\d+); checkpoint in", logs)
    assert stop is not None, logs[-3000:]
    kind = ".dcp" if strategy == "fsdp" else ".pt"
    saved = [int(p.name[5:14]) for p in (run_dir / "checkpoints").glob(f"step-*{kind}")]
    assert saved == [int(stop.group(1))] and not (run_dir / "summary.json").exists()
