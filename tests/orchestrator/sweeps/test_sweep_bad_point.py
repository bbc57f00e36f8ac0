"""An override that only one sweep point cannot take fails before anything is queued, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from train_helpers import run_train


def test_unknown_override_in_one_point_names_the_point(tmp_path: Path) -> None:
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    # model.hidden_dim exists for the MLP, not for the transformer: only point #1 is bad.
    proc = run_train("cluster=local", "model=mlp,transformer", "model.hidden_dim=8", "cluster.wait=false",
                     sweep_dir=tmp_path / "sweep", multirun=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "sweep point #1 (cluster=local model=transformer model.hidden_dim=8" in proc.stderr
    assert "Could not override 'model.hidden_dim'" in proc.stderr
    status = subprocess.run([str(Path(sys.executable).parent / "switchyard"), "status"],
                            capture_output=True, text=True, env=env)
    assert "no sweeps recorded" in status.stdout, "nothing may be queued or recorded"
