"""A minimal real DDP job: every rank joins the process group and all-reduces its rank number.

Used by the SLURM end-to-end tests and by anyone checking that a cluster can run DDP at all:
``python -c "from jobs.smoke import allreduce; print(allreduce('/tmp/rdzv'))"`` under srun.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from orchestrator.launch import dist_env, rendezvous


@dataclass(frozen=True)
class SmokeResult:
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    hostname: str
    backend: str
    reduced: float  # sum over ranks of (rank + 1): world * (world + 1) / 2 when all took part


def smoke_device(backend: str, local_rank: int) -> torch.device:
    """Where the smoke test's tensor lives: the rank's GPU for any backend but gloo (``auto``: when
    CUDA is available), so an NCCL cluster is tested over NCCL. One visible GPU is the task's own
    (SLURM's --gpus-per-task=1), else the rank takes the one at its local rank."""
    if backend == "gloo" or (backend == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise RuntimeError(f"backend={backend} needs a GPU but this rank sees none (try backend=gloo)")
    if count > 1 and local_rank >= count:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: {count} visible (launch "
                           f"one task per GPU, or bind one GPU per task with --gpus-per-task=1)")
    return torch.device("cuda", 0 if count == 1 else local_rank)


def allreduce(rdzv_dir: str, backend: str = "auto", fail_on_rank: int | None = None,
              rendezvous_timeout_s: float = 120.0, kill_rank: int | None = None) -> dict[str, object]:
    """``fail_on_rank`` raises on that rank, ``kill_rank`` SIGKILLs it (as the OOM killer
    would), both before the rendezvous, so the other ranks would wait there for it."""
    env = dist_env.detect()
    if fail_on_rank is not None and env.rank == fail_on_rank:
        raise RuntimeError(f"deliberate failure on rank {env.rank} (fail_on_rank={fail_on_rank})")
    if kill_rank is not None and env.rank == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    device = smoke_device(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL's communicator binds to it
    chosen = rendezvous.init_process_group(env, Path(rdzv_dir), backend=backend, device=device,
                                           rendezvous_timeout_s=rendezvous_timeout_s)
    try:
        # on the rank's GPU under NCCL, which moves only CUDA tensors: a CPU tensor would go over
        # the gloo half of the group and leave NCCL untested
        value = torch.tensor([float(env.rank + 1)], device=device)
        dist.all_reduce(value)
        result = SmokeResult(rank=env.rank, local_rank=env.local_rank, node_rank=env.node_rank,
                             world_size=env.world_size, hostname=env.hostname, backend=chosen,
                             reduced=float(value.item()))
    finally:
        rendezvous.destroy_process_group()
    return asdict(result)
