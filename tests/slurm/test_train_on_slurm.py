"""The training job on the real local cluster: 2 nodes x 2 ranks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

SMALL = ["optim.max_steps=40", "data.demo_num_samples=512", "data.batch_size=16", "log_every_steps=5"]


def test_two_nodes_two_ranks_train_to_a_lower_loss(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "cluster=slurm", "parallelism.nodes=2", *SMALL,
         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert sorted(set(summary["node_per_rank"])) == ["n1", "n2"]
    assert len(set(summary["samples_per_rank"])) == 1
    assert len(set(summary["param_checksum_per_rank"])) == 1
    assert summary["eval_samples_counted"] == summary["eval_set_size"]
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]
    assert summary["final_train_loss"] < 0.7 * first
    assert slurm_query.wait_for_terminal_states([job_id])[job_id] == "COMPLETED"


def test_not_waiting_returns_after_submission(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "cluster=slurm", "cluster.wait=false", *SMALL,
         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    assert "not waiting" in proc.stdout
    assert slurm_query.wait_for_terminal_states([job_id], timeout_s=300)[job_id] == "COMPLETED"
    assert (tmp_path / "run" / "summary.json").exists()
