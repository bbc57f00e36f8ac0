"""A run whose cluster.signal_delay_s is below what its measured checkpoint saves need warns, and
the next run in the same directory with cluster.signal_delay_s=auto takes a lead time that fits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from train_helpers import run_train

from orchestrator.launch.signal_delay import fitting_s

pytestmark = pytest.mark.slurm


def train(tmp_path: Path, queued: list[str], *overrides: str) -> subprocess.CompletedProcess[str]:
    run = tmp_path / "run"
    try:
        return run_train("cluster=slurm", "checkpoint.every_steps=5", "data.demo_num_samples=256",
                         "telemetry.enabled=false", f"cluster.snapshot.dir={tmp_path / 'store'}", *overrides,
                         cache_dir=tmp_path / "cache", run_dir=run, timeout=300)
    finally:  # the job ids sbatch gave, for the fixture to cancel should the run not have ended
        queued += [p.name.split("_")[0] for p in (run / "submitit").glob("*_submission.sh")]


def test_a_signal_delay_below_the_measured_save_time_warns_and_auto_fits_it(
        tmp_path: Path, queued: list[str]) -> None:
    proc = train(tmp_path, queued, "cluster.signal_delay_s=1", "optim.max_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "signal_delay_s: 1 (cluster.signal_delay_s=1)" in proc.stdout
    assert "warning: cluster.signal_delay_s=1 may be too short" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    slowest = summary["checkpoint_slowest_save_s"]
    assert slowest > 0
    assert any("try cluster.signal_delay_s=" in w for w in summary["checkpoint_warnings"])
    assert summary["signal_delay"] == {"seconds": 1, "source": "cluster.signal_delay_s=1"}

    # The shared checkout may change between the two runs: the resume is about the lead time.
    proc = train(tmp_path, queued, "cluster.signal_delay_s=auto", "optim.max_steps=15",
                 "checkpoint.allow_code_change=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = fitting_s(slowest)
    assert f"signal_delay_s: {chosen} (auto: 2 x {slowest:.1f} s, the slowest checkpoint save" in proc.stdout
    scripts = sorted((tmp_path / "run" / "submitit").glob("*_submission.sh"), key=lambda p: p.stat().st_mtime)
    assert f"#SBATCH --signal=USR2@{chosen}\n" in scripts[-1].read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["signal_delay"]["seconds"] == chosen
    assert summary["signal_delay"]["source"].startswith(f"auto: 2 x {slowest:.1f} s")
