"""Training-step throughput: Switchyard's trainer vs a minimal hand-written DDP loop.

Same model, same data (the demo dataset), same world size, same batch size, both over gloo in
processes started by this script, measured in one run. The hand-written loop is what a user would
write first: DistributedSampler + per-sample reads + a padding collate + DDP + AdamW, nothing else.
Switchyard's loop does more per step (padding masks, exactly-once accounting, a stop-flag
all-reduce for preemption, reduced metrics); the target is >= 0.95x the hand-written loop.

    python bench/train_bench.py                      # 2 ranks, mlp, 300 steps, 3 repeats
    python bench/train_bench.py --model transformer --steps 200
    python bench/train_bench.py --device cuda --world 1 --batch-size 256 --workers 4   # on a GPU node

On CUDA both loops put the model on the rank's GPU, use NCCL, pinned memory and non-blocking copies
(what a user who knows the idiom writes); the target there is >= 0.98x the hand-written loop.

Throughput is samples/s over steps after a warm-up, best of the repeats (this machine has 2 cores
shared with everything else; best-of filters the noise).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from jobs.demo_data import ensure_demo_dataset
from orchestrator.config import (
    DataConfig,
    MlpConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
    TransformerConfig,
)
from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import runtime, trainer
from orchestrator.training.step import build_model
from sharding import collate_padded, open_dataset


def make_cfg(args: argparse.Namespace) -> TrainConfig:
    model: Any = MlpConfig() if args.model == "mlp" \
        else TransformerConfig(d_model=args.d_model, num_layers=args.layers, ff_dim=2 * args.d_model)
    return TrainConfig(model=model, data=DataConfig(batch_size=args.batch_size, cache_dir=args.cache_dir,
                                                    demo_num_samples=args.samples, num_workers=args.workers),
                       optim=OptimConfig(max_steps=args.steps), telemetry=TelemetryConfig(enabled=False),
                       log_every_steps=args.window)


class PerSample(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, path: str) -> None:
        self.ds = open_dataset(path)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.ds[i]


def hand_written(cfg: TrainConfig, path: str, rank: int, world: int, window: int,
                 device: torch.device) -> list[float]:
    """Returns samples/s per window of steps (all ranks' samples)."""
    torch.manual_seed(0)
    ds = PerSample(path)
    # the trainer's own builder: the model.* keys that are the trainer's (model.compile) stay out
    built = build_model(cfg.model, {"in_features": cfg.data.demo_features,
                                    "num_classes": cfg.data.demo_classes}, cfg.memory)
    model = DistributedDataParallel(built.to(device),
                                    device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(ds, batch_size=cfg.data.batch_size, sampler=sampler, collate_fn=collate_padded,
                        num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda")
    rates, step, epoch, start = [], 0, 0, time.perf_counter()
    while step < cfg.optim.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            x, mask, y = (batch[k].to(device, non_blocking=True) for k in ("x", "x_mask", "y"))
            loss = torch.nn.functional.cross_entropy(model(x, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % window == 0:
                dist.all_reduce(loss.detach())  # what a user logs: one reduced loss per window
                rates.append(window * cfg.data.batch_size * world / (time.perf_counter() - start))
                start = time.perf_counter()
            if step == cfg.optim.max_steps:
                break
        epoch += 1
    return rates


def switchyard(cfg: TrainConfig, paths: trainer.DataPaths, rank: int, world: int,
               run_dir: Path, device: torch.device) -> list[float]:
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0,
                  num_nodes=1, master_addr="127.0.0.1", hostname="bench", job_id="bench", restart_count=0,
                  source="local")
    rt = runtime.Runtime(env=env, device=device, backend="nccl" if device.type == "cuda" else "gloo")
    trainer.Trainer(cfg, paths, run_dir, rt).run()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    return [json.loads(line)["samples_per_s"] for line in lines]


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    # the group Switchyard's runtime makes: gloo on CPU, cpu:gloo,cuda:nccl on GPUs
    dist.init_process_group(rendezvous.group_backend("nccl" if device.type == "cuda" else "gloo"),
                            store=dist.FileStore(store, world), rank=rank, world_size=world,
                            device_id=device if device.type == "cuda" else None)
    cfg = make_cfg(args)
    train_path, _ = ensure_demo_dataset(cfg.data)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        if args.variant == "switchyard":
            rates = switchyard(cfg, trainer.DataPaths(train=str(train_path), eval=None), rank, world, run_dir,
                               device)
        else:
            rates = hand_written(cfg, str(train_path), rank, world, args.window, device)
    if rank == 0:
        out.put(rates)
    dist.destroy_process_group()


def wait_for_rates(out: Any, procs: list[Any], timeout_s: float = 1800) -> list[float]:
    """Rank 0's rates; a rank that died first (its traceback is above) ends the bench at once
    instead of leaving it to wait out the timeout, as it once did on a GPU node for 30 minutes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"train_bench: rank(s) {', '.join(f'{r} (exit {c})' for r, c in dead)} "
                                 f"died before reporting; see the traceback above") from None
    raise SystemExit(f"train_bench: no result within {timeout_s:.0f} s")


def measure(args: argparse.Namespace, variant: str) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = argparse.Namespace(**{**vars(args), "variant": variant})
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, args.world, f"{tmp}/store", args, out))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        rates = wait_for_rates(out, procs)
        for p in procs:
            p.join()
    steady = rates[1:] or rates  # the first window holds start-up (first batches, bucket rebuild)
    return sorted(steady)[len(steady) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: rank r on cuda:r over NCCL, pinned memory (needs --world <= GPUs)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank, both loops")
    parser.add_argument("--d-model", type=int, default=64, help="transformer width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "switchyard-bench-train"))
    args = parser.parse_args()
    ensure_demo_dataset(make_cfg(args).data)
    results: dict[str, list[float]] = {"hand-written DDP loop": [], "switchyard trainer": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        results["hand-written DDP loop"].append(measure(args, "hand"))
        results["switchyard trainer"].append(measure(args, "switchyard"))
    base = max(results["hand-written DDP loop"])
    print(f"device={args.device} model={args.model} world={args.world} batch={args.batch_size}/rank "
          f"workers={args.workers} steps={args.steps} "
          f"(median samples/s over {args.window}-step windows, best of {args.repeats})")
    print("| loop | samples/s | x hand-written |\n|---|---|---|")
    for name, rates in results.items():
        print(f"| {name} | {max(rates):,.0f} | {max(rates) / base:.2f} |")


if __name__ == "__main__":
    main()
