"""Hydra's own launcher test suites, run against switchyard_slurm on the local SLURM cluster, as the
official launcher plugins run them against theirs.

Blocking mode (the suites check return values), one node, one task, two-minute time limit: each
sweep is a real sbatch array round trip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import (
    BatchedSweeperTestSuite,
    IntegrationTestSuite,
    LauncherTestSuite,
)

from hydra_plugins.switchyard_launcher.launcher import SwitchyardLauncher

pytestmark = pytest.mark.slurm

LAUNCHER_SETTINGS = {"timeout_min": 2, "poll_s": 0.2, "wait": True}


@pytest.fixture(autouse=True)
def private_registry(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Sweeps go to a throwaway registry (the in-process suites and the subprocess ones alike)."""
    path = tmp_path_factory.mktemp("registry") / "registry.db"
    monkeypatch.setenv("SWITCHYARD_REGISTRY", str(path))
    return path


def test_discovery() -> None:
    assert SwitchyardLauncher.__name__ in [c.__name__ for c in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize(("launcher_name", "overrides"), [
    ("switchyard_slurm", [f"hydra.launcher.{k}={v}" for k, v in LAUNCHER_SETTINGS.items()]),
])
class TestSwitchyardSlurmLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"), [
    ("switchyard_slurm", [f"hydra.launcher.{k}={v}" for k, v in LAUNCHER_SETTINGS.items()]
     + ["hydra.sweeper.max_batch_size=2"]),
])
class TestSwitchyardSlurmLauncherBatches(BatchedSweeperTestSuite):
    """Hydra hands the launcher 3 batches of 2: three launch() calls, one array each."""


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"), [(
    {"defaults": [{"override hydra/launcher": "switchyard_slurm"}],
     "hydra": {"launcher": LAUNCHER_SETTINGS}},
    ["-m"],
)])
class TestSwitchyardSlurmLauncherIntegration(IntegrationTestSuite):
    pass
