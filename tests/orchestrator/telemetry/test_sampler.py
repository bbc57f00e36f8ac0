"""The sampler itself against a scripted NVML: record shape, pids to ranks, CUDA_VISIBLE_DEVICES, errors.

The fake NVML (``tests/fake_nvml.py``) is injected at the module boundary (``nvml=`` arguments).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from fake_nvml import NO_ENV, PIDS, TOTAL, FakeGpu, FakeNvml, busy, register_one_rank_per_gpu, sample

from orchestrator.telemetry.common import GIB, MIB
from orchestrator.telemetry.files import register_rank
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.stats import load_records
from orchestrator.telemetry.summary import summarize


def test_records_have_the_documented_shape_and_map_pids_to_ranks(tmp_path: Path) -> None:
    fake = FakeNvml([busy(10, PIDS[0]), FakeGpu(used=[1 * GIB], util=[50], processes=[[(777, 512 * MIB)]])])
    register_one_rank_per_gpu(tmp_path, pids=PIDS[:1])
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=NO_ENV)
    record = sampler.sample_once()
    sampler.stop()
    assert set(record) == {"t", "node", "attempt", "sample_s", "gpus"}
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
    records = load_records(tmp_path)
    assert len(records) == 2 and records[0]["ranks"][0]["pid"] == os.getpid()


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    sample(tmp_path, FakeNvml([busy(10, 1)]), num_samples=2)
    with open(tmp_path / "telemetry" / "n1.jsonl", "a") as f:
        f.write('{"t": 17, "node": "n1", "gpus": [{"ind')  # killed mid-write
    assert summarize(tmp_path)["num_samples"] == 3


def test_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"interval_s=0 is invalid: must be > 0 \(try interval_s=5.0\)"):
        MemorySampler(tmp_path, "n1", interval_s=0, nvml=None)


def test_sampler_finds_each_ranks_gpu_by_cuda_uuid_not_by_ordinal(tmp_path: Path) -> None:
    """ConstrainDevices: the job holds NVML GPUs 1 and 3 and sees them as "0,1". Read as NVML
    indices those are GPUs 0 and 1, another job's; the UUIDs CUDA reports name 1 and 3."""
    fake = FakeNvml([busy(10, 1) for _ in range(4)])
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    uuids = [fake.gpus[1].uuid.removeprefix("GPU-"), fake.gpus[3].uuid.removeprefix("GPU-")]
    for rank in (0, 1):
        register_rank(tmp_path, rank, rank, "n1", rank, environ=env, pid=PIDS[rank], device_uuid=uuids[rank])
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=env, cuda_uuids=uuids)
    record = sampler.sample_once()
    sampler.stop()
    assert [(g["index"], g["cuda"], g["ranks"]) for g in record["gpus"]] == [(1, 0, [0]), (3, 1, [1])]


def test_stop_gives_up_on_a_sample_stuck_in_nvml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU fallen off the bus: the NVML call never returns. stop() must still return, or rank 0
    never reaches the final barrier."""
    fake = FakeNvml([busy(10, 1)])
    stuck, release = threading.Event(), threading.Event()

    def hang(handle: FakeGpu) -> SimpleNamespace:
        stuck.set()
        release.wait(30)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    fake.nvmlDeviceGetMemoryInfo = hang  # type: ignore[method-assign]
    sampler = MemorySampler(tmp_path, "n1", interval_s=0.01, nvml=fake, environ=NO_ENV).start()
    try:
        assert stuck.wait(10)
        start = time.monotonic()
        sampler.stop(timeout_s=0.2)
        assert time.monotonic() - start < 5
        assert "its sample did not return within 0.2 s" in capsys.readouterr().out
    finally:
        release.set()
