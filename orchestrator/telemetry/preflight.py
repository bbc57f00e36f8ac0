"""Preflight, on every rank before the process group starts: every local rank has a GPU of its own
(more may be visible), and each GPU's free memory goes into the rank's log.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.telemetry.common import PreflightError, gib
from orchestrator.telemetry.nvml import (
    NVML_ERRORS,
    NvmlApi,
    NvmlChoice,
    describe_visible,
    resolve_nvml,
    visible_gpus,
)

# Preflight: less free than this before training means another job or a stale process holds the GPU.
PREFLIGHT_FREE_WARN_FRACTION = 0.9


@dataclass(frozen=True)
class GpuMemory:
    index: int  # NVML index
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class PreflightReport:
    local_rank: int
    device_index: int | None  # the CUDA ordinal this rank should use; None for CPU training
    device_nvml_index: int | None
    gpus: tuple[GpuMemory, ...] = ()  # every GPU this rank sees, with its free memory now
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the rank's log."""
        if self.device_index is None:
            return f"preflight local rank {self.local_rank}: CPU training, no GPU checks"
        free = ", ".join(f"GPU {g.index} {gib(g.free_bytes)}/{gib(g.total_bytes)} GiB" for g in self.gpus)
        nvml = "not shown by NVML: a MIG instance or no permission" if self.device_nvml_index is None \
            else f"GPU {self.device_nvml_index}"
        line = (f"preflight local rank {self.local_rank}: cuda:{self.device_index} ({nvml}); "
                f"free memory: {free}")
        return "; ".join([line, *self.warnings])


def preflight(gpus_per_node: int, local_rank: int, local_world_size: int,
              nvml: NvmlApi | NvmlChoice | None = "auto",
              environ: Mapping[str, str] | None = None,
              cuda_uuids: Sequence[str] | None = None) -> PreflightReport:
    """Before training: every local rank on this node has a GPU of its own.

    Two layouts pass: every rank sees at least as many GPUs as the node runs ranks (rank uses
    ``cuda:<local_rank>``; extra GPUs stay unused, as under ``cluster=debug``), or SLURM binds one
    GPU per task (each rank sees one, ``cuda:0``). ``cuda_uuids``: each CUDA ordinal's UUID, from
    CUDA (a training rank passes them; see ``nvml``'s docstring for why). NVML refusing a query
    (NO_PERMISSION in a container) is a warning: only a layout that cannot work raises
    :class:`PreflightError`.
    """
    if gpus_per_node == 0:
        return PreflightReport(local_rank=local_rank, device_index=None, device_nvml_index=None)
    env = os.environ if environ is None else environ
    api = resolve_nvml(nvml)
    if api is None:
        raise PreflightError(
            f"parallelism.gpus_per_node={gpus_per_node} but this node has no NVIDIA driver (NVML did not "
            f"load): run on a GPU node (--gpus-per-node={gpus_per_node}) or set "
            f"parallelism.gpus_per_node=0 for CPU training")
    visible, refused = _visible(api, env, cuda_uuids, local_world_size)
    device = _device_for_rank(gpus_per_node, local_rank, local_world_size, len(visible), env)
    gpus, unread = _gpu_memories(api, [i for i in visible if i is not None])
    return PreflightReport(local_rank=local_rank, device_index=device, device_nvml_index=visible[device],
                           gpus=gpus, warnings=(*refused, *unread, *_busy_warnings(gpus)))


def _visible(nvml: NvmlApi, env: Mapping[str, str], cuda_uuids: Sequence[str] | None,
             local_world_size: int) -> tuple[list[int | None], tuple[str, ...]]:
    """NVML index per CUDA ordinal, and a warning if NVML refused to list them (unknown: None)."""
    try:
        return visible_gpus(nvml, env, cuda_uuids), ()
    except NVML_ERRORS as e:
        # Count what CUDA will show without NVML: the variable's entries, else one per rank.
        spec = env.get("CUDA_VISIBLE_DEVICES")
        count = len(cuda_uuids) if cuda_uuids is not None else \
            local_world_size if spec is None else len(spec.split(","))
        return [None] * count, (f"NVML refused to list this node's GPUs ({e}): their memory is not "
                                f"checked (a container may need the NVIDIA runtime's utility capability)",)


def _gpu_memories(nvml: NvmlApi, indices: Iterable[int]) -> tuple[tuple[GpuMemory, ...], tuple[str, ...]]:
    gpus, unread = [], []
    for index in indices:
        try:
            gpus.append(_gpu_memory(nvml, index))
        except NVML_ERRORS as e:  # NO_PERMISSION on a GPU: the rank trains, unmeasured
            unread.append(f"GPU {index}: NVML refused its memory ({e})")
    return tuple(gpus), tuple(unread)


def _device_for_rank(gpus_per_node: int, local_rank: int, local_world_size: int, num_visible: int,
                     env: Mapping[str, str]) -> int:
    """This rank's CUDA ordinal. A rank needs only its own GPU: more visible GPUs than ranks is
    fine (``cluster=debug`` runs one rank on a node showing all of them; ``torchrun
    --nproc-per-node=2`` on an 8-GPU box). Too few fails on every rank alike, not only on the
    ranks left without one, so none of them waits at the rendezvous for the others."""
    if num_visible == 1 and local_world_size == gpus_per_node:
        return 0  # one GPU bound per task (--gpus-per-task=1 or --gpu-bind): every rank uses cuda:0
    if num_visible >= local_world_size:
        return local_rank
    where = describe_visible(env)
    if local_world_size == gpus_per_node:
        raise PreflightError(
            f"parallelism.gpus_per_node={gpus_per_node} but this node shows {num_visible} GPUs ({where}): "
            f"request --gpus-per-node={gpus_per_node} or set parallelism.gpus_per_node={num_visible}")
    raise PreflightError(
        f"this node runs {local_world_size} ranks but shows {num_visible} GPUs ({where}): local ranks "
        f"{num_visible} to {local_world_size - 1} have no GPU of their own; launch one rank per GPU "
        f"(--ntasks-per-node={num_visible})")


def _gpu_memory(nvml: NvmlApi, index: int) -> GpuMemory:
    mem = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
    return GpuMemory(index=index, free_bytes=int(mem.free), total_bytes=int(mem.total))


def _busy_warnings(gpus: Iterable[GpuMemory]) -> Iterator[str]:
    for g in gpus:
        if g.free_bytes < PREFLIGHT_FREE_WARN_FRACTION * g.total_bytes:
            yield (f"GPU {g.index} has only {gib(g.free_bytes)} of {gib(g.total_bytes)} GiB free before "
                   f"training: another job or a stale process holds it (nvidia-smi shows which)")
