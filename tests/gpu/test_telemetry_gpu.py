"""Telemetry against the real driver: NVML, torch's allocator counters, a stray allocation on another GPU.

Skipped where no NVIDIA GPU is visible; run with ``pytest -m gpu tests/gpu`` on a GPU node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.telemetry.common import MIB
from orchestrator.telemetry.files import record_rank_peak, register_rank
from orchestrator.telemetry.nvml import NvmlApi, load_nvml, visible_gpus
from orchestrator.telemetry.plot import plot_run
from orchestrator.telemetry.preflight import preflight
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.summary import summarize

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and driver"),
]

HELD_MIB = 256


@pytest.fixture
def nvml() -> NvmlApi:
    api = load_nvml()
    assert api is not None, "torch sees a GPU but NVML did not load"
    return api


@pytest.fixture
def held_on_cuda0() -> Iterator[object]:
    """A 256 MiB tensor on cuda:0, with torch's peak counters reset around it."""
    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats(0)
    tensor = torch.empty(HELD_MIB * MIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    yield tensor
    del tensor
    torch.cuda.empty_cache()


def test_preflight_passes_on_this_node(nvml: NvmlApi) -> None:
    count = torch.cuda.device_count()
    report = preflight(count, local_rank=0, local_world_size=count, nvml=nvml)
    assert report.device_index == 0 and len(report.gpus) == count
    assert all(0 < g.free_bytes <= g.total_bytes for g in report.gpus)
    assert len(visible_gpus(nvml, os.environ)) == count


def test_sampler_sees_this_process_memory(tmp_path: Path, nvml: NvmlApi, held_on_cuda0: object) -> None:
    register_rank(tmp_path, 0, 0, socket.gethostname(), device_index=0)
    sampler = MemorySampler(tmp_path, socket.gethostname(), nvml=nvml)
    record = sampler.sample_once()
    sampler.stop()
    own = next(g for g in record["gpus"] if g["cuda"] == 0)
    assert own["used_bytes"] >= HELD_MIB * MIB and own["ranks"] == [0]
    assert record["sample_s"] < 0.05
    mine = [p for p in own["processes"] or [] if p["pid"] == os.getpid()]
    if mine:  # absent inside a container's PID namespace: NVML lists host pids
        assert mine[0]["rank"] == 0 and (mine[0]["used_bytes"] or HELD_MIB * MIB) >= HELD_MIB * MIB


def test_rank_peak_reads_torch_allocator(tmp_path: Path, held_on_cuda0: object) -> None:
    peak = record_rank_peak(tmp_path, rank=0, device_index=0)
    assert peak["max_allocated_bytes"] >= HELD_MIB * MIB
    assert peak["max_reserved_bytes"] >= peak["max_allocated_bytes"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_memory_on_another_gpu_is_flagged(tmp_path: Path, nvml: NvmlApi, held_on_cuda0: object) -> None:
    """The seed mistake for real: rank 0 of GPU 1 leaves a tensor on cuda:0."""
    torch.cuda.set_device(1)
    torch.cuda.reset_peak_memory_stats(1)
    on_own = torch.empty(HELD_MIB * MIB, dtype=torch.uint8, device="cuda:1")
    register_rank(tmp_path, 0, 0, socket.gethostname(), device_index=1)
    sampler = MemorySampler(tmp_path, socket.gethostname(), nvml=nvml)
    sampler.sample_once()
    sampler.stop()
    record_rank_peak(tmp_path, rank=0, device_index=1)
    del on_own
    flags = summarize(tmp_path)["flags"]
    assert any(f.startswith("rank 0") and ("cuda:0" in f or "on GPU" in f) for f in flags), flags
    assert plot_run(tmp_path).stat().st_size > 10_000
