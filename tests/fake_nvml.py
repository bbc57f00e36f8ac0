"""A scripted NVML for the telemetry tests (CI has no GPU), the only mock there, and a PNG size reader.

It is injected at the module boundary (``nvml=`` arguments), never patched into pynvml.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pynvml

from orchestrator.telemetry.common import GIB
from orchestrator.telemetry.files import register_rank
from orchestrator.telemetry.sampler import MemorySampler

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
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)


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

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGpu:
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return handle.name

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return handle.capability

    def nvmlDeviceGetIndex(self, handle: FakeGpu) -> int:
        return next(i for i, gpu in enumerate(self.gpus) if gpu is handle)

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


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


_OPENED: list[list[str]] = []  # the lists of the `opened_samples` blocks in progress


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _OPENED and Path(str(args[0])).parent.name == "telemetry" \
            and str(args[0]).endswith(".jsonl"):
        for opened in _OPENED:
            opened.append(str(args[0]))


@contextmanager
def opened_samples() -> Iterator[list[str]]:
    """The raw sample files (``telemetry/*.jsonl``) this process opens inside the block, through Python's
    audit hook (one hook for the session: hooks cannot be removed)."""
    if not getattr(sys, "_switchyard_audit", False):
        sys.addaudithook(_audit)
        sys._switchyard_audit = True  # type: ignore[attr-defined]
    opened: list[str] = []
    _OPENED.append(opened)
    try:
        yield opened
    finally:
        _OPENED.remove(opened)
