"""Telemetry: the sampler, its flags and its summary against a scripted NVML (CI has no GPU), and the
CPU fallback for real with child processes that hold memory.

The fake NVML is injected at the module boundary (``nvml=`` arguments): the only mock in this file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import telemetry
from orchestrator.telemetry import (
    GIB,
    MIB,
    GpuStats,
    MemorySampler,
    PreflightError,
    TelemetryError,
    format_summary,
    imbalance_flags,
    plot_run,
    preflight,
    record_rank_peak,
    register_rank,
    summarize,
    visible_gpus,
)

TOTAL = 80 * GIB
NO_ENV: dict[str, str] = {}


@dataclass
class FakeGpu:
    """One GPU's script: value i is what NVML reports at tick i (the last value repeats)."""

    used: list[int]
    util: list[int]
    processes: list[list[tuple[int, int]]] = field(default_factory=list)  # per tick: (pid, bytes)
    total: int = TOTAL
    uuid: str = ""


class FakeNvml:
    """The pynvml functions telemetry uses, scripted over ticks; ``advance()`` moves time on."""

    def __init__(self, gpus: list[FakeGpu], deny_processes: bool = False) -> None:
        self.gpus = gpus
        self.tick = 0
        self.deny_processes = deny_processes
        for i, gpu in enumerate(gpus):
            gpu.uuid = gpu.uuid or f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"

    def advance(self) -> None:
        self.tick += 1

    def _at(self, series: list[int]) -> int:
        return series[min(self.tick, len(series) - 1)]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        used = self._at(handle.used)
        return SimpleNamespace(used=used, total=handle.total, free=handle.total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._at(handle.util), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[SimpleNamespace]:
        if self.deny_processes:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if not handle.processes:
            return []
        listed = handle.processes[min(self.tick, len(handle.processes) - 1)]
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in listed]


PIDS = [4100, 4101, 4102, 4103]


def register_one_rank_per_gpu(run_dir: Path, node: str = "n1", pids: list[int] = PIDS) -> None:
    for rank, pid in enumerate(pids):
        register_rank(run_dir, rank, local_rank=rank, node=node, device_index=rank, environ=NO_ENV, pid=pid)


def sample(run_dir: Path, fake: FakeNvml, num_samples: int = 6, node: str = "n1") -> None:
    """Drive the sampler tick by tick (deterministic), then stop it (one final sample)."""
    sampler = MemorySampler(run_dir, node, interval_s=5.0, nvml=fake, environ=NO_ENV)
    for _ in range(num_samples):
        sampler.sample_once()
        fake.advance()
    sampler.stop()


def ramp(start_gib: float, end_gib: float, steps: int = 6) -> list[int]:
    return [int((start_gib + (end_gib - start_gib) * i / (steps - 1)) * GIB) for i in range(steps)]


def busy(used_gib: float, pid: int) -> FakeGpu:
    return FakeGpu(used=[int(used_gib * GIB)], util=[95], processes=[[(pid, int((used_gib - 0.5) * GIB))]])


# --- the two seed problems, and two more -----------------------------------------------------------------


def test_one_gpu_doing_all_the_work_flags_the_three_idle_gpus(tmp_path: Path) -> None:
    """(a) Every rank forgot torch.cuda.set_device: they all run on GPU 0, GPUs 1-3 stay idle."""
    all_on_gpu0 = [[(pid, 3 * GIB) for pid in PIDS]]
    fake = FakeNvml([FakeGpu(used=ramp(2, 14), util=[0, 90, 92, 91, 90, 93], processes=all_on_gpu0)]
                    + [FakeGpu(used=[300 * MIB], util=[0]) for _ in range(3)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)

    idle = [f for f in memory["flags"] if "stayed idle" in f]
    assert [f.split(" stayed")[0] for f in idle] == [f"GPU {i} on n1 (rank {i})" for i in (1, 2, 3)]
    assert all("ranks 0, 1, 2, 3 all run on GPU 0" in f for f in idle)
    assert not any("peaked at" in f for f in memory["flags"])  # idle peers are no yardstick for GPU 0
    gpu0 = memory["gpus"][0]
    assert gpu0["peak_used_bytes"] == 14 * GIB and gpu0["mean_util_pct"] > 70


def test_all_ranks_run_on_gpu0_when_every_rank_registers_cuda0(tmp_path: Path) -> None:
    """Same mistake seen from the ranks' side: each registers cuda:0 because it never set a device."""
    fake = FakeNvml([FakeGpu(used=[12 * GIB], util=[90], processes=[[(pid, 3 * GIB) for pid in PIDS]])]
                    + [FakeGpu(used=[0], util=[0]) for _ in range(3)])
    for rank, pid in enumerate(PIDS):
        register_rank(tmp_path, rank, rank, "n1", device_index=0, environ=NO_ENV, pid=pid)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]
    assert len(flags) == 3
    assert all("(no rank) stayed idle" in f and "ranks 0, 1, 2, 3 all run on GPU 0" in f for f in flags)


def test_gpu0_holding_extra_memory_is_flagged(tmp_path: Path) -> None:
    """(b) Every rank loads a checkpoint onto cuda:0: GPU 0 holds +6 GiB over its busy peers."""
    fake = FakeNvml([FakeGpu(used=ramp(8, 16), util=[90],
                             processes=[[(PIDS[0], 9 * GIB)] + [(pid, 2 * GIB) for pid in PIDS[1:]]])]
                    + [busy(10, pid) for pid in PIDS[1:]])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]

    [imbalance] = [f for f in flags if "peaked at" in f]
    assert imbalance.startswith("GPU 0 on n1 peaked at 16.0 GiB, 1.6x the median of its peers (10.0 GiB)")
    assert "ranks 1, 2, 3 also hold memory here" in imbalance and "map_location='cpu'" in imbalance
    assert not any("stayed idle" in f for f in flags)


def test_extra_memory_is_flagged_without_process_lists(tmp_path: Path) -> None:
    """NVML may refuse process lists (containers): the imbalance still shows in the per-GPU numbers."""
    gpus = [FakeGpu(used=[16 * GIB], util=[90])] + [FakeGpu(used=[10 * GIB], util=[90]) for _ in range(3)]
    fake = FakeNvml(gpus, deny_processes=True)
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)
    assert [f[:24] for f in memory["flags"]] == ["GPU 0 on n1 peaked at 16"]
    assert all(g["processes"] == [] for g in memory["gpus"])


def test_rank_holding_memory_on_another_gpu_is_flagged(tmp_path: Path) -> None:
    """(c) Rank 2's process is listed on GPU 0 as well as on its own GPU 2."""
    gpus = [busy(10, pid) for pid in PIDS]
    gpus[0].processes = [[(PIDS[0], int(9.5 * GIB)), (PIDS[2], int(1.1 * GIB))]]
    fake = FakeNvml(gpus)
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]
    assert flags == [f"rank 2 (pid {PIDS[2]}) holds 1.1 GiB on GPU 0 on n1, its own device is GPU 2: "
                     f"call torch.cuda.set_device(local_rank) first and load with map_location='cpu'"]


def test_balanced_healthy_run_has_no_flags(tmp_path: Path) -> None:
    """(d) Four busy GPUs within 10 % of each other, each rank on its own."""
    fake = FakeNvml([FakeGpu(used=ramp(9 + i * 0.3, 10 + i * 0.3), util=[88 + i],
                             processes=[[(pid, 9 * GIB)]]) for i, pid in enumerate(PIDS)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)
    assert memory["flags"] == [] and memory["notes"] == []
    assert memory["mode"] == "gpu" and memory["num_samples"] == 7  # 6 + the final one at stop()
    assert [g["ranks"] for g in memory["gpus"]] == [[0], [1], [2], [3]]
    assert [g["processes"] for g in memory["gpus"]][3] == [{"rank": 3, "peak_used_bytes": 9 * GIB}]


def test_gpu0_on_every_node_is_flagged_against_peers_across_nodes(tmp_path: Path) -> None:
    for node, pids in (("n1", PIDS), ("n2", [p + 100 for p in PIDS])):
        gpus = [busy(16, pids[0])] + [busy(10, pid) for pid in pids[1:]]
        for rank, pid in enumerate(pids):
            register_rank(tmp_path, rank + (4 if node == "n2" else 0), rank, node, rank, NO_ENV, pid=pid)
        sample(tmp_path, FakeNvml(gpus), node=node)
    flags = summarize(tmp_path)["flags"]
    assert [f.split(" peaked")[0] for f in flags] == ["GPU 0 on n1", "GPU 0 on n2"]


def test_short_run_is_not_called_idle(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(used=[1 * GIB], util=[90]), FakeGpu(used=[0], util=[0])])
    sample(tmp_path, fake, num_samples=1)  # 2 samples: the job ended during start-up
    assert summarize(tmp_path)["flags"] == []


def test_torch_peaks_flag_other_devices_when_nvml_pids_do_not_match(tmp_path: Path) -> None:
    """In a container NVML lists host pids; the allocator's own per-device counters still tell."""
    fake = FakeNvml([busy(10, 90000 + i) for i in range(2)])
    register_one_rank_per_gpu(tmp_path, pids=PIDS[:2])
    sample(tmp_path, fake)
    peak = {"rank": 1, "device": 1, "max_allocated_bytes": 8 * GIB, "max_reserved_bytes": 9 * GIB,
            "other_devices": [{"device": 0, "max_reserved_bytes": 2 * GIB}]}
    (tmp_path / "telemetry" / "peaks").mkdir()
    (tmp_path / "telemetry" / "peaks" / "rank-1.json").write_text(json.dumps(peak))
    memory = summarize(tmp_path)
    assert memory["flags"] == [
        "rank 1 reserved 2.0 GiB on cuda:0 through torch, its own device is cuda:1: "
        "call torch.cuda.set_device(local_rank) first and load with map_location='cpu'"]
    assert "PID namespace" in memory["notes"][0]
    assert memory["ranks"][1]["end"]["max_allocated_bytes"] == 8 * GIB


@settings(max_examples=60, deadline=None)
@given(peaks_gib=st.lists(st.floats(2.0, 2.4), min_size=2, max_size=8), extra=st.data())
def test_imbalance_flags_exactly_the_gpu_with_extra_memory(peaks_gib: list[float],
                                                           extra: st.DataObject) -> None:
    def stats(peaks: list[float]) -> list[GpuStats]:
        return [GpuStats("n1", i, total_bytes=TOTAL, peak_used_bytes=int(p * GIB), num_samples=5,
                         util_samples=[90.0]) for i, p in enumerate(peaks)]

    assert imbalance_flags(stats(peaks_gib)) == []  # within 20 % of each other: DDP replicas agree
    heavy = extra.draw(st.integers(0, len(peaks_gib) - 1))
    bumped = [p + 6.0 if i == heavy else p for i, p in enumerate(peaks_gib)]
    [flag] = imbalance_flags(stats(bumped))
    assert flag.startswith(f"GPU {heavy} on n1 peaked at")


# --- the sampler itself ----------------------------------------------------------------------------------


def test_records_have_the_documented_shape_and_map_pids_to_ranks(tmp_path: Path) -> None:
    fake = FakeNvml([busy(10, PIDS[0]), FakeGpu(used=[1 * GIB], util=[50], processes=[[(777, 512 * MIB)]])])
    register_one_rank_per_gpu(tmp_path, pids=PIDS[:1])
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=NO_ENV)
    record = sampler.sample_once()
    sampler.stop()
    assert set(record) == {"t", "node", "sample_s", "gpus"}
    assert record["gpus"][0] == {"index": 0, "cuda": 0, "used_bytes": 10 * GIB, "total_bytes": TOTAL,
                                 "util_pct": 95.0, "ranks": [0],
                                 "processes": [{"pid": PIDS[0], "rank": 0, "used_bytes": int(9.5 * GIB)}]}
    assert record["gpus"][1]["processes"] == [{"pid": 777, "rank": None, "used_bytes": 512 * MIB}]
    lines = (tmp_path / "telemetry" / "n1.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == record


def test_sampler_follows_cuda_visible_devices_and_each_ranks_own_view(tmp_path: Path) -> None:
    """The job holds NVML GPUs 2 and 3. Rank 1 is bound to one GPU (its cuda:0 is GPU 3)."""
    fake = FakeNvml([busy(10, 1) for _ in range(4)])
    register_rank(tmp_path, 0, 0, "n1", 0, environ={"CUDA_VISIBLE_DEVICES": "2,3"}, pid=PIDS[0])
    register_rank(tmp_path, 1, 1, "n1", 0, environ={"CUDA_VISIBLE_DEVICES": fake.gpus[3].uuid}, pid=PIDS[1])
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    record = sampler.sample_once()
    sampler.stop()
    assert [(g["index"], g["cuda"], g["ranks"]) for g in record["gpus"]] == [(2, 0, [0]), (3, 1, [1])]


def test_thread_samples_on_its_interval_and_once_more_at_stop(tmp_path: Path) -> None:
    fake = FakeNvml([busy(10, 1)])
    with MemorySampler(tmp_path, "n1", interval_s=0.05, nvml=fake, environ=NO_ENV):
        time.sleep(0.4)
    lines = (tmp_path / "telemetry" / "n1.jsonl").read_text().splitlines()
    assert 4 <= len(lines) <= 12
    times = [json.loads(line)["t"] for line in lines]
    assert times == sorted(times)


def test_a_failing_sample_does_not_stop_the_thread(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeNvml([busy(10, 1)])
    calls = {"n": 0}
    real = fake.nvmlDeviceGetMemoryInfo

    def flaky(handle: FakeGpu) -> SimpleNamespace:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("driver hiccup")
        return real(handle)

    fake.nvmlDeviceGetMemoryInfo = flaky  # type: ignore[method-assign]
    with MemorySampler(tmp_path, "n1", interval_s=0.02, nvml=fake, environ=NO_ENV):
        time.sleep(0.3)
    assert capsys.readouterr().out.count("a sample failed") == 1
    assert len((tmp_path / "telemetry" / "n1.jsonl").read_text().splitlines()) >= 3


def test_nvml_errors_on_one_gpu_are_recorded_and_skipped(tmp_path: Path) -> None:
    fake = FakeNvml([busy(10, 1), busy(10, 2)])
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=NO_ENV)
    fake.gpus.pop()  # GPU 1 fell off the bus after start-up
    record = sampler.sample_once()
    sampler.stop()
    error = str(pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT))
    assert record["gpus"][1] == {"index": 1, "error": error}
    assert [g["index"] for g in summarize(tmp_path)["gpus"]] == [0]


def test_nvml_that_cannot_list_gpus_falls_back_to_cpu_mode(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    class BrokenNvml(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    register_rank(tmp_path, 0, 0, "n1", None)  # this process
    with MemorySampler(tmp_path, "n1", interval_s=1.0, nvml=BrokenNvml([]), environ=NO_ENV) as sampler:
        pass
    sampler.stop()  # a second stop is a no-op
    assert not sampler.is_gpu
    assert capsys.readouterr().out.startswith("GPU telemetry off (NVML cannot list GPUs: GPU is lost)")
    records = telemetry.load_records(tmp_path)
    assert len(records) == 2 and records[0]["ranks"][0]["pid"] == os.getpid()


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    sample(tmp_path, FakeNvml([busy(10, 1)]), num_samples=2)
    with open(tmp_path / "telemetry" / "n1.jsonl", "a") as f:
        f.write('{"t": 17, "node": "n1", "gpus": [{"ind')  # killed mid-write
    assert summarize(tmp_path)["num_samples"] == 3


def test_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"interval_s=0 is invalid: must be > 0 \(try interval_s=5.0\)"):
        MemorySampler(tmp_path, "n1", interval_s=0, nvml=None)


# --- CUDA_VISIBLE_DEVICES and preflight ------------------------------------------------------------------


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


def test_preflight_local_rank_beyond_visible_devices() -> None:
    with pytest.raises(PreflightError) as info:
        preflight(4, local_rank=5, local_world_size=6, nvml=four_free_gpus(), environ=NO_ENV)
    assert str(info.value) == ("local rank 5 has no GPU of its own: this node runs 6 ranks but shows 4 GPUs "
                               "(CUDA_VISIBLE_DEVICES unset): launch one rank per GPU (--ntasks-per-node=4)")
    # every rank fails the same way, not only the ones past the end
    with pytest.raises(PreflightError, match=r"^this node runs 6 ranks but parallelism.gpus_per_node=4"):
        preflight(4, local_rank=0, local_world_size=6, nvml=four_free_gpus(), environ=NO_ENV)


def test_preflight_fewer_ranks_than_gpus_would_leave_gpus_idle() -> None:
    with pytest.raises(PreflightError, match=r"runs 3 ranks but .*gpus_per_node=4: 1 GPU\(s\) would"):
        preflight(4, local_rank=0, local_world_size=3, nvml=four_free_gpus(), environ=NO_ENV)


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
    assert telemetry.load_nvml() is None


# --- the CPU fallback, for real --------------------------------------------------------------------------

CHILD = """
import sys, time, pathlib
from orchestrator.telemetry import register_rank
run_dir, rank, mib = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
held = b"x" * (mib << 20)  # written, so resident and private
register_rank(run_dir, rank, local_rank=rank, node="cpu-node", device_index=None)
(run_dir / f"ready-{rank}").touch()
time.sleep(60)
"""


@pytest.fixture
def two_ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two real processes holding 40 and 120 MiB, registered as ranks 0 and 1 of node cpu-node."""
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(rank), str(mib)])
                for rank, mib in ((0, 40), (1, 120))]
    try:
        deadline = time.monotonic() + 20
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "child ranks did not start within 20 s"
            assert all(c.poll() is None for c in children), "a child rank exited early"
            time.sleep(0.05)
        yield children
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_cpu_fallback_records_rss_and_uss_of_real_ranks(
        tmp_path: Path, two_ranks: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]) -> None:
    with MemorySampler(tmp_path, "cpu-node", interval_s=0.1, nvml=None) as sampler:
        time.sleep(1.0)
    assert not sampler.is_gpu
    assert capsys.readouterr().out.count(telemetry.CPU_MODE_INFO) == 1

    lines = (tmp_path / "telemetry" / "cpu-node.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) >= 5
    pids = [(0, two_ranks[0].pid), (1, two_ranks[1].pid)]
    assert all([(r["rank"], r["pid"]) for r in record["ranks"]] == pids for record in records)
    for rank, mib in ((0, 40), (1, 120)):
        readings = [r for record in records for r in record["ranks"] if r["rank"] == rank]
        assert all(r["rss_bytes"] >= mib * MIB and r["shared_bytes"] > 0 for r in readings)
        uss = [r["uss_bytes"] for r in readings if r["uss_bytes"] is not None]
        assert uss and all(mib * MIB <= u <= max(r["rss_bytes"] for r in readings) for u in uss)

    memory = summarize(tmp_path)
    assert memory["mode"] == "cpu" and memory["flags"] == []
    assert memory["ranks"][1]["peak_uss_bytes"] >= 120 * MIB
    [node] = memory["nodes"]
    assert node["peak_total_uss_bytes"] >= 160 * MIB
    assert node["peak_total_rss_bytes"] >= node["peak_total_uss_bytes"]
    assert "cpu-node rank 1: peak RSS" in format_summary(memory)
    png = plot_run(tmp_path)
    assert png == tmp_path / "telemetry" / "memory.png"
    width, height = png_size(png)
    assert width == 1000 and height > 300 and png.stat().st_size > 10_000


def test_uss_reads_are_rationed_but_rss_is_read_every_sample(
        tmp_path: Path, two_ranks: list[subprocess.Popen[bytes]]) -> None:
    sampler = MemorySampler(tmp_path, "cpu-node", nvml=None)
    first, second = sampler.sample_once()["ranks"], sampler.sample_once()["ranks"]
    sampler.stop()
    assert all(r["uss_bytes"] is not None for r in first)
    # a USS read is due again only after 100x its own cost (>= 10 ms here): not microseconds later
    assert all(r["uss_bytes"] is None and r["rss_bytes"] > 0 for r in second)


def test_cpu_sampler_skips_ranks_that_exited(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    register_rank(tmp_path, 0, 0, "n1", None, pid=child.pid)
    register_rank(tmp_path, 1, 1, "n1", None)  # this process
    sampler = MemorySampler(tmp_path, "n1", nvml=None)
    record = sampler.sample_once()
    sampler.stop()
    assert [r["rank"] for r in record["ranks"]] == [1]


def test_record_rank_peak_on_cpu(tmp_path: Path) -> None:
    peak = record_rank_peak(tmp_path, rank=3, device_index=None)
    on_disk = json.loads((tmp_path / "telemetry" / "peaks" / "rank-3.json").read_text())
    assert on_disk == peak and peak["device"] is None
    assert peak["max_rss_bytes"] >= peak["uss_bytes"] > 10 * MIB
    assert summarize(tmp_path)["ranks"] == [{"rank": 3, "node": None, "local_rank": None, "pid": None,
                                             "device": None, "peak_rss_bytes": None, "peak_uss_bytes": None,
                                             "end": peak}]


def test_cpu_rank_with_far_more_private_memory_is_flagged(tmp_path: Path) -> None:
    uss = {0: 6 * GIB, 1: 2 * GIB, 2: int(2.1 * GIB), 3: int(1.9 * GIB)}
    lines = [{"t": t, "node": "n1", "sample_s": 0.001,
              "ranks": [{"rank": r, "pid": 10 + r, "rss_bytes": u + GIB, "shared_bytes": GIB,
                         "uss_bytes": u if t == 1.0 else None}  # USS is not read every sample
                        for r, u in uss.items()]}
             for t in (1.0, 2.0)]
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "n1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    memory = summarize(tmp_path)
    assert memory["flags"] == [
        "rank 0 on n1 peaked at 6.0 GiB of private memory (USS), 3.0x the median of its peers (2.0 GiB): "
        "it keeps something the others do not (evaluation data, a second copy of the dataset?)"]
    assert memory["nodes"] == [{"node": "n1", "peak_total_rss_bytes": sum(uss.values()) + 4 * GIB,
                                "peak_total_uss_bytes": sum(uss.values())}]


# --- summary text and plot -------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_summary_is_json_and_status_text_shows_peaks_util_and_flags(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(used=ramp(2, 14), util=[90])] + [FakeGpu(used=[0], util=[0]) for _ in range(3)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = json.loads(json.dumps(summarize(tmp_path)))
    text = format_summary(memory)
    assert "n1 GPU 0: peak  14.0 / 80.0 GiB, mean util   90%, rank 0" in text
    assert text.count("  ! ") == 3


def test_plot_draws_one_subplot_per_node_with_flags(tmp_path: Path) -> None:
    for node in ("n1", "n2"):
        sample(tmp_path, FakeNvml([FakeGpu(used=ramp(2, 14), util=[90]), FakeGpu(used=[0], util=[0])]),
               node=node)
    out = plot_run(tmp_path, tmp_path / "plots" / "mem.png")
    width, height = png_size(out)
    assert width == 1000 and height > 700  # two nodes stacked, and a line per flag under them
    assert out.stat().st_size > 20_000  # lines, legends and text, not an empty canvas


def test_plot_of_an_empty_run_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match=r"no telemetry samples in .*telemetry: was the memory sampler"):
        plot_run(tmp_path)
    assert summarize(tmp_path)["mode"] == "none"


def test_sampling_cost_is_recorded_and_small(tmp_path: Path) -> None:
    """Overhead of the sampler's own work (rank table, records, JSON, write) for 8 GPUs and 8 ranks."""
    fake = FakeNvml([busy(10, 100 + i) for i in range(8)])
    for rank in range(8):
        register_rank(tmp_path, rank, rank, "n1", rank, NO_ENV, pid=100 + rank)
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=NO_ENV)
    costs = [sampler.sample_once()["sample_s"] for _ in range(50)]
    sampler.stop()
    assert statistics.median(costs) < 0.005
    assert summarize(tmp_path)["sample_cost_ms"]["mean"] is not None
