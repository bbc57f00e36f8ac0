"""NVML, reached only through one :class:`NvmlApi` object, and which GPUs this process sees.

NVML comes from :func:`load_nvml` or is injected by a caller (tests pass a fake). GPU numbers in
messages are NVML's (``nvidia-smi``'s). CUDA ordinals are mapped to them by each device's UUID,
which a training rank reads from CUDA itself: ``CUDA_VISIBLE_DEVICES`` integers are not NVML
indices under SLURM's ConstrainDevices (a job on physical GPU 5 sees ``0``), and CUDA's default
FASTEST_FIRST order can differ from NVML's PCI order. The variable is read only where CUDA cannot
be asked (a Switchyard process around a user's command, which must not start CUDA).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

try:
    import pynvml as _pynvml
except ImportError:  # nvidia-ml-py is a dependency, but a broken install must not stop training
    _pynvml = None

NvmlChoice = Literal["auto"]

class NvmlApi(Protocol):
    """The handful of pynvml functions this module uses; the ``pynvml`` module itself satisfies it."""

    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any: ...

    def nvmlDeviceGetIndex(self, handle: Any) -> int: ...

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .used .total .free, bytes

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu, percent

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...  # .pid .usedGpuMemory

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...  # (8, 0): A100


# What NVML raises when a query is refused (no permission in a container, GPU fell off the bus).
NVML_ERRORS: tuple[type[BaseException], ...] = \
    (OSError,) if _pynvml is None else (_pynvml.NVMLError, OSError)


def load_nvml() -> NvmlApi | None:
    """NVML, initialised; None where NVIDIA's driver (libnvidia-ml) is absent."""
    if _pynvml is None:
        return None
    try:
        _pynvml.nvmlInit()
    except NVML_ERRORS:
        return None
    nvml: NvmlApi = _pynvml  # the module itself has every function NvmlApi names
    return nvml


def resolve_nvml(nvml: NvmlApi | NvmlChoice | None) -> NvmlApi | None:
    return load_nvml() if nvml == "auto" else nvml


def visible_gpus(nvml: NvmlApi, environ: Mapping[str, str],
                 cuda_uuids: Sequence[str] | None = None) -> list[int | None]:
    """NVML index of each CUDA ordinal, in order.

    With ``cuda_uuids`` (each ordinal's UUID as CUDA reports it, see the module's docstring) each
    is looked up by UUID. Without, from ``CUDA_VISIBLE_DEVICES``: ``2,3`` -> ``[2, 3]``; like CUDA,
    the list stops at the first entry naming no GPU (``0,-1,1`` -> ``[0]``). ``None`` marks an
    ordinal NVML cannot report on as a whole GPU (a MIG instance, or one NVML refuses to show).
    """
    if cuda_uuids is not None:
        return [_index_by_uuid(nvml, u) for u in cuda_uuids]
    count = nvml.nvmlDeviceGetCount()
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    uuids: list[str] | None = None
    result: list[int | None] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith("MIG-"):
            result.append(None)
            continue
        if re.fullmatch(r"-?\d+", entry):
            index: int | None = int(entry) if 0 <= int(entry) < count else None
        else:
            uuids = uuids if uuids is not None else _uuids(nvml, count)
            index = _match_uuid(entry, uuids)
        if index is None:
            break
        result.append(index)
    return result


def _index_by_uuid(nvml: NvmlApi, uuid: str) -> int | None:
    # torch prints a UUID bare (its CUuuid), NVML wants the "GPU-" prefix nvidia-smi shows
    wanted = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    if wanted.startswith("MIG-"):
        return None
    try:
        return int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(wanted)))
    except NVML_ERRORS:
        return None  # NO_PERMISSION (a container), a MIG instance's bare UUID: no telemetry for it


def _uuids(nvml: NvmlApi, count: int) -> list[str]:
    raw = (nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count))
    return [u.decode() if isinstance(u, bytes) else u for u in raw]


def _match_uuid(entry: str, uuids: list[str]) -> int | None:
    # CUDA accepts a unique prefix of a UUID, with or without the "GPU-" prefix
    wanted = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    matches = [i for i, u in enumerate(uuids) if entry and u.startswith(wanted)]
    return matches[0] if len(matches) == 1 else None


def describe_visible(environ: Mapping[str, str]) -> str:
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if spec is None else f"CUDA_VISIBLE_DEVICES={spec}"
