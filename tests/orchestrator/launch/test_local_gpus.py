"""cluster=local hands the GPUs to its ranks: submitit's LocalExecutor hides every GPU unless told.

Real submitit local jobs, no GPU needed: what is checked is the ``CUDA_VISIBLE_DEVICES`` each rank
starts with, the contract the GPU path reads (preflight, then ``cuda:<local_rank>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.config import AppGroups, ClusterConfig, ParallelismConfig
from orchestrator.launch import submit
from orchestrator.sweeps.arrays import LauncherSettings, resources_for

GPU2 = ParallelismConfig(nodes=1, gpus_per_node=2)


def visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def ranks_see(tmp_path: Path, parallelism: ParallelismConfig) -> list[str | None]:
    executor = submit.make_executor(ClusterConfig(mode="local"), parallelism, tmp_path / "submitit")
    job = executor.submit(visible_devices)
    return [task.result() for task in job._sub_jobs]  # one result per rank


def test_each_local_rank_sees_the_requested_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ranks_see(tmp_path, GPU2) == ["0,1", "0,1"]  # each rank then takes cuda:<local_rank>


def test_local_ranks_get_the_gpus_this_shell_was_given(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7,2")  # a shared workstation: GPUs 5 and 7 are ours
    assert ranks_see(tmp_path, GPU2) == ["5,7", "5,7"]


def test_gpu_uuids_are_passed_on_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uuids = "GPU-8a1f0c2e-0000-0000-0000-000000000001,GPU-8a1f0c2e-0000-0000-0000-000000000002"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids)
    assert ranks_see(tmp_path, GPU2) == [uuids, uuids]


def test_cpu_ranks_see_no_gpu(tmp_path: Path) -> None:
    assert ranks_see(tmp_path, ParallelismConfig(nodes=1, procs_per_node=2)) == ["", ""]


def test_a_local_sweep_point_asks_for_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    point = AppGroups(ClusterConfig(mode="local"), GPU2)
    resources = resources_for(LauncherSettings(executor="local"), point)
    assert resources.params["gpus_per_node"] == 2 and resources.params["tasks_per_node"] == 2
