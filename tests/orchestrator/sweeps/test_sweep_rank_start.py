"""How a sweep point's ranks start (``cluster.rank_start``): a training point's are forked from one
import per node, a command's (``switchyard run -m``) are started as processes. The sweeps that run
this way, locally and on the real cluster, are in tests/orchestrator/sweeps and tests/slurm."""

from __future__ import annotations

from dataclasses import asdict

from orchestrator.config import AppGroups, ClusterConfig, ParallelismConfig
from orchestrator.sweeps.arrays import LauncherSettings, Resources, resources_for

TRAINER = ("orchestrator.training.rank_process", "torch._dynamo")


def test_a_training_points_ranks_are_forked_and_a_commands_are_started() -> None:
    settings, parallelism = LauncherSettings(executor="slurm"), ParallelismConfig(nodes=2)
    train = resources_for(settings, AppGroups(ClusterConfig(mode="slurm"), parallelism, TRAINER))
    assert train.rank_modules == [*TRAINER, "orchestrator.sweeps.node"]  # the points' rank entry too
    assert resources_for(settings, AppGroups(ClusterConfig(mode="slurm"), parallelism)).rank_modules == []
    spawned = resources_for(settings, AppGroups(ClusterConfig(mode="slurm", rank_start="spawn"), parallelism,
                                                TRAINER))
    assert spawned.rank_modules == [] and spawned.key() != train.key()  # never one array together
    assert resources_for(settings, None).rank_modules == []  # an app without Switchyard's groups


def test_resources_recorded_before_forked_sweeps_read_as_started() -> None:
    recorded = asdict(resources_for(LauncherSettings(executor="local"), None))
    del recorded["rank_modules"]
    assert Resources.from_json(recorded).rank_modules == []
