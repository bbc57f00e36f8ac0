"""One rank's runtime: device, process group, DDP wrapping, and the collectives the trainer needs.

Order matters on GPU: the device is set from the local rank *before* the process group starts,
otherwise every rank's NCCL communicator (and anything created on the "current" device) lands on
GPU 0. Models are wrapped in DistributedDataParallel, never DataParallel, which drives all GPUs
from one process and in practice leaves GPU 0 doing the work.
"""

from __future__ import annotations

import datetime
import os
import random
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import ClusterConfig, ConfigError, ParallelismConfig
from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.telemetry import nccl


class StartupMismatchError(RuntimeError):
    """Ranks disagree on something that must be equal before the first step (would hang later)."""


@dataclass(frozen=True)
class Runtime:
    env: DistEnv
    device: torch.device
    backend: str
    nccl_log: Path | None = None  # this rank's NCCL start-up log (telemetry.nccl), where written

    @property
    def is_main(self) -> bool:
        return self.env.is_main


def start(env: DistEnv, parallelism: ParallelismConfig, cluster: ClusterConfig,
          rdzv_dir: Path, device_index: int | None = None, run_dir: Path | None = None) -> Runtime:
    """``device_index``: the CUDA ordinal preflight chose (``cuda:0`` when SLURM binds one GPU per
    task), else the local rank. ``run_dir``: an NCCL rank writes NCCL's start-up log there, read
    for the transport it chose (``report_nccl_transport``)."""
    device = _select_device(env, parallelism, device_index)
    torch.set_num_threads(thread_budget(env.local_world_size))
    is_nccl = rendezvous.choose_backend(parallelism.backend, device) == "nccl"
    nccl_log = nccl.enable_debug_log(run_dir, env.rank) if is_nccl and run_dir is not None else None
    backend = rendezvous.init_process_group(
        env, rdzv_dir, backend=parallelism.backend, device=device,
        rendezvous_timeout_s=cluster.rendezvous_timeout_s,
        collective_timeout_s=startup_timeout_s(cluster))
    return Runtime(env=env, device=device, backend=backend, nccl_log=nccl_log)


def startup_timeout_s(cluster: ClusterConfig) -> float:
    """What a collective may wait before the first step has ended. The ranks reach their first
    collectives apart by their imports (a shared file system's import storm), DDP's import of
    ``torch._dynamo``, a compile warm-up and a checkpoint's load; a short ``collective_timeout_s``,
    set to name a hang quickly, would fail a healthy start (as torchtitan's init and train
    timeouts keep apart)."""
    return max(cluster.init_timeout_s, cluster.collective_timeout_s)


def start_training_timeout(cluster: ClusterConfig) -> None:
    """After the first step: every later collective waits ``cluster.collective_timeout_s``. A
    per-rank setting of the default group's backends (gloo's and NCCL's watchdog), no collective."""
    if dist.is_initialized() and startup_timeout_s(cluster) != cluster.collective_timeout_s:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=cluster.collective_timeout_s))


BF16_CAPABILITY = (8, 0)  # the CUDA compute capability from which a GPU computes in bf16 (A100 on)


def bf16_refusal(gpu: str) -> str:
    return (f"memory.amp=bf16 is invalid on {gpu}: it has no bf16 (compute capability below 8.0) "
            f"(try memory.amp=fp16, which trains with a gradient scaler, or memory.amp=none for fp32)")


def check_bf16(device: torch.device, amp: str) -> None:
    """``memory.amp=bf16`` on this rank's own GPU, where submission could not know it (a SLURM job
    naming no GPU type): refused before the first step, by every rank alike."""
    if amp != "bf16" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < BF16_CAPABILITY:
        raise ConfigError(bf16_refusal(f"{torch.cuda.get_device_name(device)} ({device}, compute "
                                       f"capability {major}.{minor})"))


def set_tf32(device: torch.device, enabled: bool) -> None:
    """``memory.tf32``: fp32 matmuls and convolutions on a GPU rank run on TF32 tensor cores (torch
    leaves cuBLAS's off, so every fp32 GEMM on an A100 or H100 ran at plain FP32 speed). A CPU rank
    is left alone: torch's float32 matmul precision also steers oneDNN on CPUs that have bf16."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


# cuBLAS's deterministic workspace: 8 buffers of 4 MiB (":16:8", 8 of 16 KiB, is slower)
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def enable_determinism(environ: MutableMapping[str, str] | None = None) -> None:
    """``deterministic=true``: torch's deterministic algorithms, and the cuBLAS workspace they need.

    On CUDA, torch raises at the first matmul under ``use_deterministic_algorithms(True)`` unless
    ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` or ``:16:8``; cuBLAS reads it when the rank first
    creates a handle, so call this before the rank touches CUDA. A value the user set is kept.
    """
    env = os.environ if environ is None else environ
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)


def thread_budget(local_world_size: int) -> int:
    """Threads per rank: the user's ``OMP_NUM_THREADS`` where set (a positive whole number), as
    under torchrun; else the cores this task may run on, shared by the node's ranks. Without a
    budget each rank would start one thread per core. The cores are the task's cpuset (SLURM's
    --cpus-per-task, taskset), not ``os.cpu_count()``, which counts the whole node: on a 128-core
    node 8 ranks would start 16 threads each, 128 threads switching on 16 allowed cores."""
    users = os.environ.get("OMP_NUM_THREADS", "").strip()
    if users.isdigit() and int(users) > 0:
        return int(users)
    return max(1, len(os.sched_getaffinity(0)) // max(local_world_size, 1))


def cuda_uuids(gpus_per_node: int) -> list[str] | None:
    """Each visible CUDA device's UUID, in CUDA's order, for telemetry to find it in NVML: CUDA
    ordinals are not NVML indices (SLURM's ConstrainDevices renumbers from 0, and CUDA's default
    order is fastest first, NVML's is PCI bus order). None on CPU or without CUDA."""
    if gpus_per_node == 0 or not torch.cuda.is_available():
        return None
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def device_uuid(uuids: list[str] | None, device_index: int | None) -> str | None:
    if uuids is None or device_index is None or not 0 <= device_index < len(uuids):
        return None
    return uuids[device_index]


def _select_device(env: DistEnv, parallelism: ParallelismConfig, device_index: int | None
                   ) -> torch.device:
    if parallelism.gpus_per_node == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"parallelism.gpus_per_node={parallelism.gpus_per_node} but rank "
                           f"{env.rank} on {env.hostname} sees no CUDA device (try "
                           f"parallelism.gpus_per_node=0 for CPU training)")
    index = env.local_rank if device_index is None else device_index
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {env.local_rank} on {env.hostname} has no GPU of its own: "
                           f"{torch.cuda.device_count()} visible, parallelism.gpus_per_node="
                           f"{parallelism.gpus_per_node}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def stop() -> None:
    rendezvous.destroy_process_group()


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (seed); per-rank streams for anything random in data/dropout.

    The model is built on the host, so the CPU generator carries the shared seed; each rank's CUDA
    generator gets its own (``torch.manual_seed`` alone gives every GPU the same stream, so every
    rank would draw the same dropout masks). Seeding CUDA is lazy: it never starts CUDA by itself.
    """
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed + rank)


def uses_cuda() -> bool:
    """Whether this process has started CUDA: a CPU rank on a GPU machine must not create a CUDA
    context (hundreds of MiB on GPU 0) just to save or restore a generator it never drew from."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def wrap(model: nn.Module, rt: Runtime) -> DistributedDataParallel:
    if isinstance(model, nn.DataParallel):
        warnings.warn("the model arrived wrapped in nn.DataParallel: unwrapping it. DataParallel "
                      "drives every GPU from one process and leaves GPU 0 doing most of the work; "
                      "Switchyard runs one process per GPU with DistributedDataParallel instead.",
                      stacklevel=2)
        model = model.module
    model = model.to(rt.device)
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def settle_buckets(model: DistributedDataParallel,
                   forward: Callable[[torch.nn.Module], torch.Tensor]) -> None:
    """One zero-gradient forward/backward so DDP rebuilds its gradient buckets now.

    DDP reorders its buckets after a process's first backward. With more than two ranks, gloo's
    ring all-reduce sums each element in an order that depends on its position in the bucket, so a
    resumed process (first step on the initial layout) would drift from an uninterrupted one (step
    N on the rebuilt layout) by rounding. Settling before the first real step, in every run, gives
    every real step the same layout: resumed runs stay bit-identical. Eval mode leaves BatchNorm
    statistics alone; the zero loss leaves gradients at zero.
    """
    was_training = model.training
    model.eval()
    out = forward(model)  # one real example batch, as the task calls the model
    (out.float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)


# ------------------------------------------------------------------------------------------------
# Collectives


def agree(rt: Runtime, **values: int | str) -> None:
    """Every rank must hold the same values; if not, every rank raises the same clear error.

    Called before the first step: a rank with a different batch count would otherwise hang at
    the collective after its last batch, and a different dataset would train silently wrong.
    """
    mine = dict(sorted(values.items()))
    everyone: list[Any] = [None] * rt.env.world_size
    dist.all_gather_object(everyone, mine)
    if all(v == mine for v in everyone):
        return
    lines = [f"  rank {r}: " + ", ".join(f"{k}={v}" for k, v in vals.items())
             for r, vals in enumerate(everyone)]
    raise StartupMismatchError("ranks disagree before the first step (this would hang or train on "
                               "different data):\n" + "\n".join(lines) +
                               "\nCheck that every node sees the same dataset files and config.")


def global_sums(rt: Runtime, sums: torch.Tensor) -> list[float]:
    """``sums`` summed over ranks where it lives, read once (a log or eval step's host sync)."""
    reduced = sums.detach().to(torch.float64, copy=True)
    dist.all_reduce(reduced)
    return [float(v) for v in reduced.tolist()]


def global_max(rt: Runtime, value: int, also: torch.Tensor | None = None) -> int:
    """The largest of one host integer per rank: a CPU tensor, so it rides gloo beside NCCL.
    ``also``: more int64 host values reduced by MAX in the same collective, written back in place."""
    box = torch.tensor([value], dtype=torch.int64)
    if also is not None:
        box = torch.cat([box, also])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    if also is not None:
        also.copy_(box[1:])
    return int(box[0].item())


def gather(rt: Runtime, value: Any) -> list[Any]:
    """One value per rank, in rank order, on every rank."""
    out: list[Any] = [None] * rt.env.world_size
    dist.all_gather_object(out, value)
    return out


def report_nccl_transport(rt: Runtime) -> str | None:
    """After the first NCCL collectives (DDP's or FSDP's broadcast of the initial weights): the
    transports every rank's NCCL log names, printed by rank 0 in one line. Every rank calls it."""
    if rt.backend != "nccl":
        return None
    found = nccl.Transports()
    for each in gather(rt, nccl.read(rt.nccl_log)):
        found.merge(each)
    line = nccl.describe(found)
    if rt.is_main and line is not None:
        print(line, flush=True)
    return line


def broadcast(rt: Runtime, value: Any) -> Any:
    """Rank 0's value, on every rank."""
    box = [value if rt.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
