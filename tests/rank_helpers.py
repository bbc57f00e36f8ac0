"""One real rank for the trainer's tests, and a small dataset to train it on (``pythonpath = tests``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import runtime


@contextmanager
def one_rank(store_dir: Path, device: torch.device | None = None) -> Iterator[runtime.Runtime]:
    """A real one-rank process group as the runtime makes it: gloo on CPU, ``cpu:gloo,cuda:nccl``
    bound to the device on a GPU. DDP, no_sync and every collective run for real."""
    device = device or torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(str(store_dir / "store"), 1)
    dist.init_process_group(rendezvous.group_backend(backend), store=store, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", hostname="here", job_id="t", restart_count=0, source="single")
    try:
        yield runtime.Runtime(env=env, device=device, backend=backend)
    finally:
        dist.destroy_process_group()


def write_rows_dataset(path: Path, count: int, features: int, classes: int, max_rows: int) -> str:
    """``count`` samples of ``x: float32[0..max_rows, features]`` and ``y = i % classes``."""
    from sharding import DatasetWriter

    rng = np.random.default_rng(0)
    with DatasetWriter(path) as writer:
        for i in range(count):
            x = rng.normal(size=(int(rng.integers(0, max_rows + 1)), features)).astype(np.float32)
            writer.append({"x": x, "y": np.int64(i % classes)})
    return str(path)
