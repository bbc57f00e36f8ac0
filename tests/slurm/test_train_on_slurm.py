"""The training job on the real local cluster: 2 nodes x 2 ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import run_train, train_command

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

SMALL = ["optim.max_steps=40", "data.demo_num_samples=512", "data.batch_size=16", "log_every_steps=5"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_two_ranks_train_to_a_lower_loss(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = run_train("cluster=slurm", "parallelism.nodes=2", *SMALL, f"parallelism.strategy={strategy}",
                     cache_dir=tmp_path / "cache", run_dir=run_dir, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    # NODE, STARTED and RUNTIME of the job's row were empty: only `switchyard run` ranks reported
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["slurm_id"] == job_id and job["node"] in ("n1", "n2") and job["exit_code"] == 0
    assert job["runtime_s"] == job["ended_at"] - job["started_at"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert sorted(set(summary["node_per_rank"])) == ["n1", "n2"]
    assert len(set(summary["samples_per_rank"])) == 1
    assert len(set(summary["param_checksum_per_rank"])) == 1
    assert summary["eval_samples_counted"] == summary["eval_set_size"]
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]
    assert summary["final_train_loss"] < 0.7 * first
    assert slurm_query.wait_for_terminal_states([job_id])[job_id] == "COMPLETED"
    if strategy == "fsdp":  # each of the 4 ranks, 2 per node, wrote its own shard
        shards = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.dcp/*.distcp"))
        assert shards == [f"__{rank}_0.distcp" for rank in range(4)]


def test_a_frozen_rank_is_named_on_slurm(tmp_path: Path) -> None:
    """Before: every rank was listed as a culprit under 'failed (RUNNING)'. The cluster's nodes
    are this machine, so rank 3's process (on n2) can be frozen from here."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        train_command("cluster=slurm", "parallelism.nodes=2", "optim.max_steps=1000000",
                      "data.demo_num_samples=512", "data.batch_size=16", "telemetry.enabled=false",
                      "cluster.collective_timeout_s=8", cache_dir=tmp_path / "cache", run_dir=run_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, record = time.monotonic() + 240, {"step": -1}
        while time.monotonic() < deadline and proc.poll() is None and record["step"] < 3:
            time.sleep(0.3)
            with contextlib.suppress(OSError, ValueError):
                record = json.loads((run_dir / "heartbeat" / "rank-3.json").read_text())
        assert record["step"] >= 3, f"rank 3 never trained (exit {proc.poll()})"
        os.kill(int(record["pid"]), signal.SIGSTOP)
        _out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        for submitted in (run_dir / "submitit").glob("*_submitted.pkl"):  # pass or fail: free the nodes
            subprocess.run(["scancel", submitted.name.split("_")[0]], check=False)
    assert proc.returncode == 2, err[-3000:]
    report = err[err.index("error: job"):]
    assert re.match(r"error: job \S+ failed \((FAILED|CANCELLED)\)", report), report
    assert "rank 3 stopped answering" in report
    culprits = [line for line in report.splitlines() if re.match(r"rank \d+ on node", line)]
    assert len(culprits) == 1 and culprits[0].startswith("rank 3 on node n2"), report


def test_a_rank_alive_elsewhere_is_named_with_its_stack_on_slurm(tmp_path: Path) -> None:
    """Before: both ranks beat on at the same step, so the report said 'cannot tell which rank
    hung'. Rank 1 (on n2) spins in its model's forward while rank 0 (n1) waits in the all-reduce:
    every live rank dumps its stack and collectives, and the report names rank 1 where it was."""
    run_dir = tmp_path / "run"
    tests = str(Path(__file__).resolve().parents[1])  # model_helpers, for the ranks
    proc = run_train("cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=1",
                     "optim.max_steps=1000", "data.demo_num_samples=512", "data.batch_size=16",
                     "telemetry.enabled=false", "memory.estimate=off", "cluster.collective_timeout_s=6",
                     "model=custom", "model._target_=model_helpers.StuckOnRank1",
                     cache_dir=tmp_path / "cache",
                     run_dir=run_dir, timeout=300,
                     env={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    try:
        assert proc.returncode == 2, proc.stderr[-3000:]
        report = proc.stderr[proc.stderr.index("error: job"):]
        assert re.search(r"collective timeout: rank 1 \(n2\) last entered all_reduce #\d+ \(step \d+, "
                         r"compute\); rank 0 entered all_reduce #\d+; rank 1's stack: "
                         r"\S+model_helpers.py:\d+ in spin_in_python", report), report
        assert "where each rank was" in report and report.count("  rank ") == 2
    finally:
        for submitted in (run_dir / "submitit").glob("*_submitted.pkl"):  # pass or fail: free the nodes
            subprocess.run(["scancel", submitted.name.split("_")[0]], check=False)


def test_forked_and_started_ranks_train_bit_identically_on_slurm(tmp_path: Path, queued: list[str]) -> None:
    """One srun task per node forks its ranks (cluster.rank_start=auto) or srun starts each rank
    (spawn): the same losses and weights to the last bit, eval included. Both queued at once:
    cluster.wait=false returns once the job is submitted, and the job still runs to its end."""
    jobs = {}
    for start in ("auto", "spawn"):
        proc = run_train("cluster=slurm", "parallelism.nodes=2", "cluster.wait=false", "optim.max_steps=12",
                         "data.demo_num_samples=512", "data.batch_size=16", "eval_every_steps=6",
                         "deterministic=true", "telemetry.enabled=false", f"cluster.rank_start={start}",
                         cache_dir=tmp_path / "cache", run_dir=tmp_path / start, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not waiting" in proc.stdout
        jobs[start] = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
        queued.append(jobs[start])
    states = slurm_query.wait_for_terminal_states(list(jobs.values()), timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, states
    forked, started = (json.loads((tmp_path / s / "summary.json").read_text()) for s in ("auto", "spawn"))
    for key in ("param_checksum_per_rank", "final_train_loss", "final_eval_loss", "samples_per_rank"):
        assert forked[key] == started[key], key
    rank3 = tmp_path / "auto" / "submitit" / f"{jobs['auto']}_3_log.out"
    assert "forked from the node launcher" in rank3.read_text()
    assert not list((tmp_path / "spawn" / "submitit").glob("*_launcher.out"))
