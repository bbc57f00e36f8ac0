"""Hydra's own launcher test suites, run against switchyard_local as Hydra's submitit plugin runs
its suites against submitit_local: every case is a real sweep through the launcher, each point a
process of its own, without a SLURM round trip per case. One of the suites' sweeps runs on the
local SLURM cluster too (tests/slurm/test_hydra_launcher_on_slurm.py).

Blocking mode (the suites check return values), two-minute time limit.
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
    ("switchyard_local", [f"hydra.launcher.{k}={v}" for k, v in LAUNCHER_SETTINGS.items()]),
])
class TestSwitchyardLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"), [
    ("switchyard_local", [f"hydra.launcher.{k}={v}" for k, v in LAUNCHER_SETTINGS.items()]
     + ["hydra.sweeper.max_batch_size=2"]),
])
class TestSwitchyardLocalLauncherBatches(BatchedSweeperTestSuite):
    """Hydra hands the launcher 3 batches of 2: three launch() calls, one sweep record each."""


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"), [(
    {"defaults": [{"override hydra/launcher": "switchyard_local"}],
     "hydra": {"launcher": LAUNCHER_SETTINGS}},
    ["-m"],
)])
class TestSwitchyardLocalLauncherIntegration(IntegrationTestSuite):
    pass
