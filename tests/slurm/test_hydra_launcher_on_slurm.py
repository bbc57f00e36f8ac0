"""One sweep of Hydra's own launcher test suite against switchyard_slurm on the local SLURM
cluster: its points are one sbatch array, and Hydra gets their return values back in order. The
whole suites run on switchyard_local (tests/orchestrator/sweeps/test_hydra_launcher_suites.py),
which shares everything with switchyard_slurm but the submitit executor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite
from hydra.test_utils.test_utils import TSweepRunner

pytestmark = pytest.mark.slurm

LAUNCHER_SETTINGS = {"timeout_min": 2, "poll_s": 0.2, "wait": True}


def test_hydras_batched_sweep_runs_as_sbatch_arrays(hydra_sweep_runner: TSweepRunner, tmpdir: Any,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra hands the launcher 3 batches of 2: three launch() calls, one array each."""
    monkeypatch.setenv("SWITCHYARD_REGISTRY", str(tmp_path / "registry.db"))
    BatchedSweeperTestSuite().test_sweep_2_jobs_2_batches(
        hydra_sweep_runner, launcher_name="switchyard_slurm",
        overrides=[f"hydra.launcher.{k}={v}" for k, v in LAUNCHER_SETTINGS.items()]
        + ["hydra.sweeper.max_batch_size=2"], tmpdir=tmpdir)
