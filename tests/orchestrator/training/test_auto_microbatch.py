"""``memory.auto_microbatch=true`` on two real DDP ranks over gloo.

A test model raises ``torch.OutOfMemoryError`` above a batch size (``model_helpers``), on one rank
(half way through backward, the case that would leave DDP's bucket all-reduces half launched) or on
every rank (in forward). Every run is compared with a run started at the smaller micro-batch:
the final weights' checksums must be equal, bit for bit. They can be: the pieces of a loaded batch
of 8 are the batches of 4 the other run loads (same samples, same order, every sample of the same
shape), the loss keeps the fixed denominator 8, and both runs take the same path (pieces without
DDP's reduction, then one all-reduce), so every floating-point operation is the same.
A hang fails the test: every wait for a rank has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from rank_helpers import rank_processes

from orchestrator.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    MemoryConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import estimate, runtime, trainer
from orchestrator.training.microbatch import MicroBatchError, pieces

WORLD = 2
RANK_TIMEOUT_S = 240  # a run here takes seconds; a hang is a failure, not a stuck suite


def write_dataset(path: Path) -> str:
    """256 samples of one shape (x: float32[3, 5]), so a piece of a batch is the same tensor a
    smaller batch would be (no padding to a batch's longest row)."""
    from sharding import DatasetWriter

    rng = np.random.default_rng(0)
    with DatasetWriter(path) as writer:
        for i in range(256):
            writer.append({"x": rng.normal(size=(3, 5)).astype(np.float32), "y": np.int64(i % 3)})
    return str(path)


def config(dataset: str, run: Path, batch_size: int, accum: int, max_batch: int, steps: int = 6,
           ranks: list[int] | None = None, where: str = "forward") -> TrainConfig:
    model = {"_target_": "model_helpers.OutOfMemoryAbove", "max_batch": max_batch, "ranks": ranks or [],
             "where": where, "hidden_dim": 16}
    return TrainConfig(model=model, data=DataConfig(path=dataset, num_classes=3, batch_size=batch_size),
                       optim=OptimConfig(max_steps=steps, grad_accum_steps=accum), log_every_steps=2,
                       memory=MemoryConfig(auto_microbatch=True),
                       checkpoint=CheckpointConfig(dir=str(run / "checkpoints")),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def _rank(rank: int, store: str, cfg: TrainConfig, run: str, out: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    env = DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD, node_rank=0,
                  num_nodes=1, master_addr="127.0.0.1", hostname="here", job_id="t", restart_count=0,
                  source="local")
    rt = runtime.Runtime(env=env, device=torch.device("cpu"), backend="gloo")
    paths = trainer.DataPaths(train=str(cfg.data.path), eval=None)
    try:
        summary = trainer.Trainer(cfg, paths, Path(run), rt).run()
        out.put((rank, summary))
    except MicroBatchError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def run_ranks(cfg: TrainConfig, run: Path) -> dict[int, Any]:
    """Both ranks' results (a summary, or the give-up message); fails if a rank hangs or dies."""
    run.mkdir(parents=True, exist_ok=True)
    store = run / f"store-{len(list(run.glob('store-*')))}"
    ctx = rank_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(store), cfg, str(run), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(results) < WORLD:
            assert time.monotonic() < deadline, f"ranks {sorted(set(range(WORLD)) - set(results))} hang"
            with contextlib.suppress(queue.Empty):
                rank, result = out.get(timeout=2)
                results[rank] = result
                continue
            died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not died, f"a rank died (exit codes {died}): see its traceback above"
        return results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def logged(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The run started at micro-batch 4: batches of 4, 2 per step, never out of memory."""
    root = tmp_path_factory.mktemp("auto_microbatch")
    dataset = write_dataset(root / "data")
    done = run_ranks(config(dataset, root / "ref", batch_size=4, accum=2, max_batch=4), root / "ref")
    assert done[0]["auto_microbatch"]["changes"] == []
    return dataset, done[0]


def test_pieces_keep_every_entry_in_order_unequal_last() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "is_pad": torch.zeros(5, dtype=torch.bool),
             "index": torch.arange(5)}
    cut = pieces(batch, 2)
    assert [len(p["index"]) for p in cut] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p in cut]), batch["x"])


@pytest.mark.parametrize("ranks,where", [([1], "backward"), ([], "forward")], ids=["one-rank", "all-ranks"])
def test_an_oom_halves_the_micro_batch_and_trains_the_same_weights(
        reference: tuple[str, dict[str, Any]], tmp_path: Path, ranks: list[int], where: str) -> None:
    dataset, ref = reference
    done = run_ranks(config(dataset, tmp_path, batch_size=8, accum=1, max_batch=4, ranks=ranks,
                            where=where), tmp_path)
    assert done[0]["param_checksum_per_rank"] == ref["param_checksum_per_rank"]
    assert len(set(ref["param_checksum_per_rank"])) == 1
    change = {"step": 1, "micro_batch_size": 4, "from": 8, "ranks": ranks or [0, 1], "accumulation": 2}
    assert done[0]["auto_microbatch"] == done[1]["auto_microbatch"] == {
        "micro_batch_size": 4, "batch_size": 8, "accumulation": 2, "changes": [change]}
    assert [(m["step"], m["micro_batch_size"]) for m in logged(tmp_path) if "micro_batch_size" in m] \
        == [(1, 4)]


def test_a_resume_starts_at_the_smaller_micro_batch_and_is_exact(
        reference: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    dataset, ref = reference
    first = run_ranks(config(dataset, tmp_path, batch_size=8, accum=1, max_batch=4, steps=3), tmp_path)
    assert first[0]["auto_microbatch"]["micro_batch_size"] == 4
    done = run_ranks(config(dataset, tmp_path, batch_size=8, accum=1, max_batch=4), tmp_path)
    assert done[0]["resumed_from"]["step"] == 3
    assert done[0]["param_checksum_per_rank"] == ref["param_checksum_per_rank"]
    # started at 4: a start at 8 would have run out of memory again, a second change at step 4
    assert [c["step"] for c in done[0]["auto_microbatch"]["changes"]] == [1]


def test_below_micro_batch_1_every_rank_gives_up_naming_the_estimate(
        reference: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    dataset, _ = reference
    found = estimate.Estimate(parameters=1, gradients=1, optimizer=2, activations=3, temporary=0,
                              peak=int(2.5 * estimate.GIB))
    estimate.write_report(tmp_path, estimate.MemoryReport(found, estimate.Capacity(
        int(80 * estimate.GIB), "H100", is_gpu=True)))
    done = run_ranks(config(dataset, tmp_path, batch_size=8, accum=1, max_batch=0, ranks=[1]), tmp_path)
    for message in done.values():
        assert isinstance(message, str), message
        assert "step 1 ran out of memory on rank(s) [1] at a micro-batch of 1" in message
        assert "the estimate before submission was 2.5 GiB peak per rank of 80.0 GiB on H100" in message
        assert "memory.amp=bf16" in message


def compose_train(*overrides: str) -> TrainConfig:
    from hydra import compose, initialize_config_module

    from jobs.train import load_config
    from orchestrator.config import register_configs

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return load_config(compose(config_name="train", overrides=list(overrides)))


def test_auto_microbatch_is_off_unless_asked() -> None:
    assert compose_train().memory.auto_microbatch is False
    assert compose_train("memory.auto_microbatch=true").memory.auto_microbatch is True


def test_fsdp_with_auto_microbatch_is_refused_before_submission() -> None:
    """fsdp all-gathers inside forward and backward: one rank's OOM would leave the others waiting."""
    from orchestrator.config import ConfigError

    with pytest.raises(ConfigError, match=r"memory.auto_microbatch=True is invalid: parallelism.strategy="
                                          r"fsdp all-gathers .* \(try memory.auto_microbatch=false, or "
                                          r"parallelism.strategy=ddp\)"):
        compose_train("parallelism.strategy=fsdp", "memory.auto_microbatch=true")
