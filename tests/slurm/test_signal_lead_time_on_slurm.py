"""A run whose cluster.signal_delay_s is below what its measured checkpoint saves need warns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def test_a_signal_delay_below_the_measured_save_time_warns(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "cluster=slurm", "cluster.signal_delay_s=1",
         "optim.max_steps=10", "checkpoint.every_steps=5", "data.demo_num_samples=256",
         "telemetry.enabled=false", f"cluster.snapshot.dir={tmp_path / 'store'}",
         f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: cluster.signal_delay_s=1 may be too short" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint_slowest_save_s"] > 0
    assert any("try cluster.signal_delay_s=" in w for w in summary["checkpoint_warnings"])
