"""CUDA ordinals to NVML indices, and preflight against a scripted NVML.

The fake NVML (``tests/fake_nvml.py``) is injected at the module boundary (``nvml=`` arguments).
"""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest
from fake_nvml import NO_ENV, FakeGpu, FakeNvml

from orchestrator.telemetry.common import GIB, MIB, PreflightError
from orchestrator.telemetry.nvml import load_nvml, visible_gpus
from orchestrator.telemetry.preflight import preflight


@pytest.mark.parametrize(("spec", "expected"), [
    (None, [0, 1, 2, 3]), ("", []), ("2,3", [2, 3]), (" 3 , 1 ", [3, 1]), ("1,-1,2", [1]), ("0,7,1", [0]),
    ("GPU-00000002", [2]), ("GPU-00000003-aaaa-bbbb-cccc-000000000003,0", [3, 0]), ("00000001", [1]),
    ("GPU-0000000", []),  # a prefix matching several UUIDs names no GPU
    ("MIG-5f1a,1", [None, 1]),
])
def test_visible_gpus_map_cuda_ordinals_to_nvml_indices(spec: str | None, expected: list[int | None]) -> None:
    fake = FakeNvml([FakeGpu(used=[0], util=[0]) for _ in range(4)])
    assert visible_gpus(fake, {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec}) == expected


def four_free_gpus() -> FakeNvml:
    return FakeNvml([FakeGpu(used=[500 * MIB], util=[0]) for _ in range(4)])


def test_preflight_reports_this_ranks_device_and_free_memory() -> None:
    report = preflight(4, local_rank=2, local_world_size=4, nvml=four_free_gpus(), environ=NO_ENV)
    assert (report.device_index, report.device_nvml_index, report.warnings) == (2, 2, ())
    assert report.describe() == ("preflight local rank 2: cuda:2 (GPU 2); free memory: GPU 0 79.5/80.0 GiB, "
                                 "GPU 1 79.5/80.0 GiB, GPU 2 79.5/80.0 GiB, GPU 3 79.5/80.0 GiB")


def test_preflight_accepts_one_gpu_bound_per_task() -> None:
    report = preflight(4, local_rank=3, local_world_size=4, nvml=four_free_gpus(),
                       environ={"CUDA_VISIBLE_DEVICES": "3"})
    assert (report.device_index, report.device_nvml_index) == (0, 3)


def test_preflight_count_mismatch_names_numbers_and_fix() -> None:
    with pytest.raises(PreflightError) as info:
        preflight(4, local_rank=0, local_world_size=4, nvml=four_free_gpus(),
                  environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert str(info.value) == ("parallelism.gpus_per_node=4 but this node shows 2 GPUs "
                               "(CUDA_VISIBLE_DEVICES=0,1): request --gpus-per-node=4 or set "
                               "parallelism.gpus_per_node=2")


def test_preflight_more_ranks_than_gpus_fails_on_every_rank() -> None:
    for local_rank in (5, 0):  # every rank fails the same way, not only the ones past the end
        with pytest.raises(PreflightError) as info:
            preflight(4, local_rank=local_rank, local_world_size=6, nvml=four_free_gpus(), environ=NO_ENV)
        assert str(info.value) == ("this node runs 6 ranks but shows 4 GPUs (CUDA_VISIBLE_DEVICES unset): "
                                   "local ranks 4 to 5 have no GPU of their own; launch one rank per GPU "
                                   "(--ntasks-per-node=4)")


def test_preflight_debug_mode_one_rank_on_a_node_showing_every_gpu() -> None:
    """cluster=debug parallelism=gpu: one rank (gpus_per_node=4 from the group) on an 8-GPU box."""
    eight = FakeNvml([FakeGpu(used=[0], util=[0]) for _ in range(8)])
    report = preflight(4, local_rank=0, local_world_size=1, nvml=eight, environ=NO_ENV)
    assert (report.device_index, report.device_nvml_index) == (0, 0)
    one_of_two = preflight(4, local_rank=0, local_world_size=1, nvml=four_free_gpus(),
                           environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert (one_of_two.device_index, one_of_two.device_nvml_index) == (0, 2)


def test_preflight_fewer_ranks_than_gpus_each_takes_its_own() -> None:
    """torchrun --nproc-per-node=3 on a 4-GPU node: the fourth GPU stays unused, no rank fails."""
    reports = [preflight(3, local_rank=r, local_world_size=3, nvml=four_free_gpus(), environ=NO_ENV)
               for r in range(3)]
    assert [(r.device_index, r.device_nvml_index) for r in reports] == [(0, 0), (1, 1), (2, 2)]
    # the same from the built-in config's gpus_per_node=4 with 3 ranks started on the node
    report = preflight(4, local_rank=2, local_world_size=3, nvml=four_free_gpus(), environ=NO_ENV)
    assert report.device_index == 2


def test_preflight_without_driver_is_a_clear_error_and_cpu_training_is_a_no_op() -> None:
    with pytest.raises(PreflightError, match=r"gpus_per_node=2 but this node has no NVIDIA driver"):
        preflight(2, 0, 2, nvml=None, environ=NO_ENV)
    report = preflight(0, 1, 2, nvml=None, environ=NO_ENV)
    assert report.device_index is None and "CPU training" in report.describe()


def test_preflight_warns_about_a_gpu_already_in_use() -> None:
    fake = four_free_gpus()
    fake.gpus[1].used = [30 * GIB]
    report = preflight(4, 0, 4, nvml=fake, environ=NO_ENV)
    assert report.warnings == ("GPU 1 has only 50.0 of 80.0 GiB free before training: another job or a "
                               "stale process holds it (nvidia-smi shows which)",)


def test_load_nvml_is_none_without_the_driver() -> None:
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has NVIDIA's driver")
    assert load_nvml() is None


def bare(uuid: str) -> str:
    return uuid.removeprefix("GPU-")  # torch's CUuuid prints without NVML's prefix


def test_constrained_job_maps_its_cuda_0_to_its_own_gpu_by_uuid() -> None:
    """SLURM's ConstrainDevices: the job holds physical GPU 2, and CUDA_VISIBLE_DEVICES says "0".
    Taken as an NVML index, "0" is another job's GPU; the UUID CUDA reports finds the right one."""
    fake = four_free_gpus()
    fake.gpus[0].used = [60 * GIB]  # the other job's GPU: its memory must not be reported as ours
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    uuids = [bare(fake.gpus[2].uuid)]
    assert visible_gpus(fake, env, uuids) == [2]
    report = preflight(1, local_rank=0, local_world_size=1, nvml=fake, environ=env, cuda_uuids=uuids)
    assert (report.device_index, report.device_nvml_index) == (0, 2)
    assert [g.index for g in report.gpus] == [2] and report.warnings == ()


def test_cuda_fastest_first_order_differs_from_nvml_pci_order() -> None:
    fake = four_free_gpus()
    cuda_order = [3, 1, 0, 2]  # CUDA_DEVICE_ORDER=FASTEST_FIRST on a mixed box
    uuids = [fake.gpus[i].uuid for i in cuda_order]
    assert visible_gpus(fake, NO_ENV, uuids) == cuda_order
    report = preflight(4, local_rank=1, local_world_size=4, nvml=fake, environ=NO_ENV, cuda_uuids=uuids)
    assert (report.device_index, report.device_nvml_index) == (1, 1)
    report = preflight(4, local_rank=0, local_world_size=4, nvml=fake, environ=NO_ENV, cuda_uuids=uuids)
    assert (report.device_index, report.device_nvml_index) == (0, 3)


class DeniedNvml(FakeNvml):
    """NVML in a container without the utility capability: every query about a GPU is refused."""

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)


def test_nvml_no_permission_is_a_warning_and_the_rank_goes_on() -> None:
    fake = DeniedNvml([FakeGpu(used=[0], util=[0]) for _ in range(2)])
    uuids = [g.uuid for g in fake.gpus]
    report = preflight(2, local_rank=1, local_world_size=2, nvml=fake, environ=NO_ENV, cuda_uuids=uuids)
    assert (report.device_index, report.device_nvml_index, report.gpus) == (1, None, ())
    assert "not shown by NVML" in report.describe()
    # without CUDA's UUIDs (a Switchyard process around a user's command): the listing is refused
    env = {"CUDA_VISIBLE_DEVICES": ",".join(uuids)}
    report = preflight(2, local_rank=1, local_world_size=2, nvml=fake, environ=env)
    assert report.device_index == 1 and report.warnings[0].startswith("NVML refused to list this node's GPUs")
    # the memory query alone refused: that GPU is named, the rank goes on
    fake = four_free_gpus()

    def refuse(handle: FakeGpu) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    fake.nvmlDeviceGetMemoryInfo = refuse  # type: ignore[assignment,method-assign]
    report = preflight(4, local_rank=0, local_world_size=4, nvml=fake, environ=NO_ENV)
    assert report.gpus == () and report.warnings[0].startswith("GPU 0: NVML refused its memory")
