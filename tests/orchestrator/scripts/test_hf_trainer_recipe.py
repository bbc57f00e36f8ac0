"""The Hugging Face ``Trainer`` recipe (docs/recipes/hf_trainer.py) through ``switchyard run``: two
local ranks, one world of 2, each rank ending the same steps with the same loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[3] / "docs" / "recipes" / "hf_trainer.py"


def test_an_unmodified_hf_trainer_script_runs_as_one_world_of_2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", f"hydra.run.dir={run_dir}",
                           "parallelism.procs_per_node=2", "--", sys.executable, str(RECIPE),
                           "--max-steps", "3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    logs = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob("*_log.out")))
    ends = re.findall(r"^rank (\d)/(\d): (\d+) steps, train loss (\S+)$", logs, re.MULTILINE)
    assert sorted(rank for rank, *_ in ends) == ["0", "1"], logs[-3000:]
    assert {(world, steps) for _, world, steps, _ in ends} == {("2", "3")}
    assert len({loss for *_, loss in ends}) == 1  # one model: the ranks' losses were averaged together
    assert (run_dir / "hf").is_dir()  # the Trainer wrote into the run directory
