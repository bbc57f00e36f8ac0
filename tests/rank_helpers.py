"""One real rank for the trainer's tests, and a small dataset to train it on (``pythonpath = tests``)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from orchestrator.launch import fork_safety, rendezvous
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


TEXT_LINE = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs\n"


def write_text_dataset(root: Path) -> str:
    """A small byte-tokenized text dataset (``jobs.prepare format=text``) under ``root``: four
    documents of the same sentence, numbered; for ``task=causal_lm`` with a tiny GPT."""
    from jobs.prepare import prepare
    from orchestrator.config import PrepareConfig

    (root / "corpus").mkdir()
    for i in range(4):
        (root / "corpus" / f"{i}.txt").write_text(f"{i} {TEXT_LINE}" * 20)
    prepare(PrepareConfig(input=str(root / "corpus"), output=str(root / "d"), format="text",
                          tokenizer="bytes"))
    return str(root / "d")


# What multiprocessing's fork server imports once for every rank it forks (a spawned rank imported
# torch and the trainer again, about 2.5 s of CPU each); a module it cannot import is skipped.
RANK_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "orchestrator.training.trainer",
                "model_helpers"]
def rank_processes() -> multiprocessing.context.ForkServerContext:
    """A ``multiprocessing`` context for a test's rank processes: forked from this worker's fork
    server, which imported ``RANK_PRELOAD`` and nothing else ran in it (no thread, no torch
    operation), instead of spawned. A rank's target and arguments travel pickled, as with spawn,
    and a rank gets the server's environment (the worker's when the server started), not the
    test's: a test that sets a variable for its ranks passes it as an argument.

    The server starts with the thread settings at 1, as a local job's controller imports
    (``fork_safety.hold_thread_pools``): a fork leaves a pool's threads behind, and its ranks keep
    one intra-op thread each, so two ranks on two cores do not spin against each other."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    fork_safety.hold_thread_pools()
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        fork_safety.restore_thread_vars()
    return ctx
