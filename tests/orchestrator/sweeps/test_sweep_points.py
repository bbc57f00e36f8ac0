"""Sweep points before submission: composed once, resolved, checked, grouped into arrays."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf

import jobs.train  # noqa: F401 -- registers jobs.train's checks, as running the app does
from orchestrator.config import register_configs
from orchestrator.sweeps.arrays import LauncherSettings, SweepError, group_points, resources_for
from orchestrator.sweeps.points import Point, prepare_point

register_configs()
SMALL = ["data.demo_num_samples=64", "optim.max_steps=5"]


@pytest.fixture
def train_app(tmp_path: Path) -> Iterator[tuple[HydraContext, DictConfig]]:
    """jobs.train's config as the launcher receives it: the master config plus Hydra's loader."""
    from hydra.core.utils import setup_globals
    from hydra.plugins.launcher import Launcher  # noqa: F401  (plugins scanned: switchyard_* exist)

    setup_globals()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        master = compose("train", overrides=["cluster=slurm", f"data.cache_dir={tmp_path / 'cache'}",
                                              *SMALL], return_hydra_config=True)
        loader = GlobalHydra.instance().config_loader()
        from hydra._internal.callbacks import Callbacks

        yield HydraContext(config_loader=loader, callbacks=Callbacks()), master


def _point(train_app: tuple[HydraContext, DictConfig], tmp_path: Path, overrides: list[str],
           num: int = 0, **settings: object) -> Point:
    context, master = train_app  # a sweeper hands every point all of the command line's overrides
    common = ["cluster=slurm", f"data.cache_dir={tmp_path / 'cache'}", *SMALL]
    return prepare_point(LauncherSettings(**settings), context, master,  # type: ignore[arg-type]
                         [*common, *overrides], num, tmp_path / "sweep")


def test_a_point_is_fully_resolved_with_absolute_directories(train_app: tuple[HydraContext, DictConfig],
                                                              tmp_path: Path) -> None:
    point = _point(train_app, tmp_path, ["optim.lr=0.01"], num=3)
    assert point.run_dir == tmp_path / "sweep" / "3"
    assert point.config.hydra.runtime.output_dir == str(point.run_dir)
    assert point.config.hydra.sweep.dir == str(tmp_path / "sweep")
    assert point.config.optim.lr == 0.01 and point.total_steps == 5
    yaml = OmegaConf.to_yaml(point.config)
    assert "${" not in yaml  # nothing left to resolve on the node
    assert point.is_ddp


def test_jobs_train_points_ask_for_their_own_nodes_and_ranks(train_app: tuple[HydraContext, DictConfig],
                                                             tmp_path: Path) -> None:
    point = _point(train_app, tmp_path, ["parallelism.nodes=2", "parallelism.procs_per_node=2",
                                         "cluster.timeout_min=5"])
    params = point.resources.params
    assert (params["nodes"], params["ntasks_per_node"], params["time"]) == (2, 2, 5)
    assert "--kill-on-bad-exit=1" in params["srun_args"]
    local = _point(train_app, tmp_path, ["parallelism.nodes=2"], executor="local")
    assert local.resources.params["tasks_per_node"] == 4  # all ranks of all "nodes" on this machine


def test_a_bad_value_in_one_point_names_that_point(train_app: tuple[HydraContext, DictConfig],
                                                   tmp_path: Path) -> None:
    with pytest.raises(SweepError) as info:
        _point(train_app, tmp_path, ["optim.lr=-1"], num=7)
    assert str(info.value).startswith("sweep point #7 (cluster=slurm data.cache_dir=")
    assert ("optim.lr=-1): optim.lr=-1.0 is invalid: must be > 0 and <= 10 (try optim.lr=0.003)"
            in str(info.value))


def test_an_unknown_key_in_one_point_names_that_point(train_app: tuple[HydraContext, DictConfig],
                                                      tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"sweep point #1 \(cluster=slurm .* model=transformer "
                                         r"model.hidden_dim=8\): .*hidden_dim"):
        _point(train_app, tmp_path, ["model=transformer", "model.hidden_dim=8"], num=1)


def test_points_with_equal_resources_share_one_array(train_app: tuple[HydraContext, DictConfig],
                                                     tmp_path: Path) -> None:
    points = [_point(train_app, tmp_path, o, num=i) for i, o in enumerate([
        ["optim.lr=0.1"], ["parallelism.nodes=2"], ["optim.lr=0.2"], ["model=transformer"],
        ["parallelism.nodes=2", "optim.lr=0.3"]])]
    assert [[p.num for p in g] for g in group_points(points)] == [[0, 2, 3], [1, 4]]


def test_launcher_resources_are_checked_with_the_launchers_own_key_names() -> None:
    with pytest.raises(SweepError, match=r"hydra.launcher.timeout_min=0 is invalid"):
        resources_for(LauncherSettings(timeout_min=0), None)
    with pytest.raises(SweepError, match=r"hydra.launcher.partition='a;b' is invalid"):
        resources_for(LauncherSettings(partition="a;b"), None)
    generic = resources_for(LauncherSettings(tasks_per_node=3, partition="debug"), None)
    assert (generic.params["ntasks_per_node"], generic.params["partition"]) == (3, "debug")
    assert generic.source == "hydra.launcher"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("executor", "pbs", "hydra.launcher.executor='pbs' is invalid"),
    ("array_parallelism", 0, "hydra.launcher.array_parallelism=0 is invalid"),
    ("poll_s", 0, "hydra.launcher.poll_s=0 is invalid"),
])
def test_launcher_settings_name_the_bad_field(field: str, value: object, message: str) -> None:
    with pytest.raises(SweepError, match=message.replace("(", r"\(")):
        LauncherSettings(**{field: value})  # type: ignore[arg-type]
