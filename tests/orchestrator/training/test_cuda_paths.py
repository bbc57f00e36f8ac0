"""The CUDA paths of a rank's start, on a CPU machine: torch.cuda faked where a GPU would answer.

Each test pins what a GPU run needs (which device, which backend, which setting) and fails on the
mistake it guards against; ``make gpu-check`` runs the real thing on a GPU node.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from orchestrator.config import ClusterConfig, ConfigError, MlpConfig, ParallelismConfig, TrainConfig
from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import rank_process, runtime, train_state
from orchestrator.training.trainer import DataPaths


def fake_gpus(monkeypatch: pytest.MonkeyPatch, uuids: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))


def test_cuda_uuids_are_read_from_cuda_in_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, ["cccc", "aaaa"])
    assert runtime.cuda_uuids(gpus_per_node=2) == ["cccc", "aaaa"]
    assert runtime.cuda_uuids(gpus_per_node=0) is None  # a CPU run never starts CUDA
    assert runtime.device_uuid(["cccc", "aaaa"], 1) == "aaaa"
    assert runtime.device_uuid(None, 1) is None and runtime.device_uuid(["cccc"], None) is None


def single_env(job_id: str) -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", hostname="localhost", job_id=job_id, restart_count=0,
                   source="local")


def test_auto_backend_of_a_cpu_run_on_a_gpu_machine_is_gloo(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """gpus_per_node=0 on a node with GPUs: auto used to pick nccl because CUDA was available."""
    fake_gpus(monkeypatch, ["aaaa", "bbbb"])
    assert rendezvous.choose_backend("auto", torch.device("cpu")) == "gloo"
    assert rendezvous.choose_backend("auto", None) == "gloo"
    assert rendezvous.choose_backend("auto", torch.device("cuda", 1)) == "nccl"
    assert rendezvous.choose_backend("gloo", torch.device("cuda", 1)) == "gloo"
    rt = runtime.start(single_env("cpu-on-gpu"), ParallelismConfig(gpus_per_node=0), ClusterConfig(),
                       tmp_path / "rdzv")
    try:
        assert (rt.device, rt.backend) == (torch.device("cpu"), "gloo")
    finally:
        runtime.stop()


def test_thread_budget_is_the_tasks_cpuset_not_the_nodes_cores(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """SLURM gave the task 4 of the node's 128 cores (--cpus-per-task=4): its ranks share those 4."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's (tests/conftest.py)
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})
    assert [runtime.thread_budget(n) for n in (1, 2, 8)] == [4, 2, 1]
    from jobs import prepare  # its default worker count reads the same cpuset
    assert prepare._num_workers(0) == 4 and prepare._num_workers(7) == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    before = torch.get_num_threads()
    rt = runtime.start(single_env("one-core"), ParallelismConfig(gpus_per_node=0), ClusterConfig(),
                       tmp_path / "rdzv")
    try:
        assert torch.get_num_threads() == 1
    finally:
        runtime.stop()
        torch.set_num_threads(before)
    assert rt.backend == "gloo"


@pytest.mark.parametrize(("value", "threads"), [("3", 3), ("1", 1), ("0", 2), ("many", 2), ("", 2)])
def test_the_users_omp_num_threads_is_each_ranks_thread_count(monkeypatch: pytest.MonkeyPatch,
                                                              value: str, threads: int) -> None:
    """As under torchrun, an OMP_NUM_THREADS the user set is each rank's, whatever the cpuset's
    share (2 of 4 cores for 2 ranks here); a value that is no positive whole number is ignored."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert runtime.thread_budget(2) == threads


class ReachedCuda(Exception):
    """Raised by a fake at the rank's first CUDA call: the test has seen what it needs."""


def test_deterministic_sets_the_cublas_workspace_before_the_rank_touches_cuda(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """deterministic=true on CUDA raised at the first matmul: CUBLAS_WORKSPACE_CONFIG was unset."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen: dict[str, str | None] = {}

    def first_cuda_call(gpus_per_node: int) -> list[str]:
        seen["at_first_cuda_call"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        seen["deterministic"] = str(torch.are_deterministic_algorithms_enabled())
        raise ReachedCuda

    monkeypatch.setattr(runtime, "cuda_uuids", first_cuda_call)
    cfg = TrainConfig(model=MlpConfig(), deterministic=True, parallelism=ParallelismConfig(gpus_per_node=1))
    try:
        with pytest.raises(ReachedCuda):
            rank_process._train_rank(cfg, cast(DataPaths, None), tmp_path, single_env("det"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == {"at_first_cuda_call": ":4096:8", "deterministic": "True"}


def test_a_cublas_workspace_the_user_set_is_kept() -> None:
    environ = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    try:
        runtime.enable_determinism(environ)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    empty: dict[str, str] = {}
    try:
        runtime.enable_determinism(empty)
    finally:
        torch.use_deterministic_algorithms(False)
    assert empty == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_each_rank_seeds_its_own_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.manual_seed alone gave every GPU the same stream: every rank drew the same dropout masks."""
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    state = torch.get_rng_state()
    try:
        runtime.seed_everything(7, rank=0)
        host_0, cuda_0 = torch.get_rng_state(), seeded[-1]  # the last seed is the one that holds
        runtime.seed_everything(7, rank=3)
        assert torch.equal(torch.get_rng_state(), host_0)  # the model's init is the same on every rank
    finally:
        torch.set_rng_state(state)
    assert (cuda_0, seeded[-1]) == (7, 10)


def test_checkpointed_rng_holds_the_cuda_stream_on_a_gpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout on a GPU draws from the CUDA generator: a resume without it is not bit-identical."""
    cuda_state = {"now": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    assert "cuda" not in train_state.rng_state()  # a CPU rank never starts CUDA to checkpoint it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: cuda_state.update(now=s.clone()))
    saved = train_state.rng_state()
    assert torch.equal(saved["cuda"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    cuda_state["now"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the run drew on
    train_state.set_rng_state(saved)
    assert torch.equal(cuda_state["now"], torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_bf16_on_a_rank_whose_gpu_has_none_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SLURM job that names no GPU type passes submission; its rank knows its GPU."""
    capability = {"now": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability["now"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla V100-SXM2-16GB")
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"^memory.amp=bf16 is invalid on Tesla V100-SXM2-16GB \(cuda:0, "
                                          r"compute capability 7.0\): it has no bf16 .*memory.amp=fp16"):
        runtime.check_bf16(gpu, "bf16")
    runtime.check_bf16(gpu, "fp16")
    runtime.check_bf16(torch.device("cpu"), "bf16")  # a CPU rank's bf16 is the CPU's
    capability["now"] = (8, 0)
    runtime.check_bf16(gpu, "bf16")
