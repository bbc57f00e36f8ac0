"""`switchyard run -m ... -- COMMAND ${key}`: one job per point through the sweep launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from script_helpers import LATE_FAILURE_SCRIPT, SWEEP_SCRIPT


def test_a_command_sweep_runs_each_point_with_its_value_and_records_the_sweep(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SWEEP_SCRIPT)
    (tmp_path / "sweep" / "fixed").parent.mkdir()
    (tmp_path / "sweep" / "fixed").touch()
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "-m", "+lr=0.1,0.3",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}", "--", sys.executable, "train.py",
                           "--lr", "${lr}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"],
                                       env=env, capture_output=True, text=True, check=True).stdout)
    assert status["sweep"]["command"] == f"+lr=0.1,0.3 -- {sys.executable} train.py --lr '${{lr}}'"
    assert [(j["overrides"], j["state"]) for j in status["jobs"]] == \
        [(["+lr=0.1"], "COMPLETED"), (["+lr=0.3"], "COMPLETED")]
    assert (tmp_path / "sweep" / "1" / "command.sh").read_text().endswith("train.py --lr 0.3\n")
    logs = subprocess.run([sys.executable, "-m", "orchestrator.cli", "logs", "1/1", "--rank", "1"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "rank 1/2 lr=0.3" in logs


def test_a_rank_failing_after_rank_0_finished_fails_the_point_in_every_view(tmp_path: Path) -> None:
    """Rank 0 exits 0, rank 1 exits 3 two seconds later: the point is FAILED with exit 3 in
    status and summary.json, so ``resubmit --failed`` retries it (it was COMPLETED, exit 0, from
    rank 0's end alone)."""
    (tmp_path / "late.py").write_text(LATE_FAILURE_SCRIPT)
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "-m", "+x=1",
                           "parallelism.procs_per_node=2", f"hydra.sweep.dir={tmp_path / 'sweep'}", "--",
                           sys.executable, "late.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "1 failed" in proc.stderr, proc.stderr[-3000:]
    status = json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"],
                                       env=env, capture_output=True, text=True, check=True).stdout)
    (job,) = status["jobs"]
    assert (job["state"], job["exit_code"]) == ("FAILED", 3), job
    assert "after rank 1 had failed: rank 1 on node" in job["error"], job
    assert "exited with status 3" in job["error"]
    summary = json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())
    assert summary["exit_code"] == 3 and [r["exit_code"] for r in summary["ranks"]] == [0, 3], summary
