"""Model state per rank under ddp and fsdp, and fsdp's step throughput against ddp's.

Model state is what AdamW training keeps between steps: parameters, gradients and the two moment
buffers, 16 bytes per fp32 parameter. ddp keeps all of it on every rank; fsdp keeps 1/world of it.
Measured from the tensors themselves (a DTensor's local shard) right after an optimizer step, before
the gradients are freed, at world 1, 2 and 4; on a GPU also from ``torch.cuda.max_memory_allocated``
(which adds activations and the unit being all-gathered).

Target (issue 18): fsdp's model state per rank <= 1.1 x (total / world) + one block's state. The
throughput row is fsdp / ddp at world 2 in this run (same model, same batches, both over gloo on
CPU); no target, it shows what the all-gathers cost when the model is small.

    python bench/fsdp_bench.py                          # CPU: worlds 1, 2, 4 and throughput at 2
    python bench/fsdp_bench.py --d-model 1024 --layers 8 --device cuda --worlds 1   # one GPU
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from jobs.models import RowTransformer
from orchestrator.config import MemoryConfig, ParallelismConfig
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import strategy
from orchestrator.training.runtime import Runtime

BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's exp_avg and exp_avg_sq


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
    moments = sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the scalar step counters
    return params + moments


def build(args: argparse.Namespace) -> RowTransformer:
    torch.manual_seed(0)
    return RowTransformer(in_features=args.features, num_classes=10, d_model=args.d_model, num_heads=4,
                          num_layers=args.layers, ff_dim=4 * args.d_model)


def rank_main(rank: int, world: int, store: str, kind: str, args: argparse.Namespace, out: Any) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            store=dist.FileStore(store, world), rank=rank, world_size=world)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0,
                  num_nodes=1, master_addr="127.0.0.1", hostname="bench", job_id="b", restart_count=0,
                  source="single")
    rt = Runtime(env=env, device=device, backend="nccl" if device.type == "cuda" else "gloo")
    chosen = strategy.for_run(rt, ParallelismConfig(strategy=kind), MemoryConfig())
    model = chosen.wrap(build(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch_size, args.rows, args.features, device=device)
    mask = torch.ones(args.batch_size, args.rows, dtype=torch.bool, device=device)

    def step() -> None:
        model(x, mask).float().pow(2).mean().backward()
        optimizer.step()

    step()
    state = model_state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    for _ in range(2):  # warm-up
        step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    out.put((rank, state, args.steps / elapsed, peak))
    dist.destroy_process_group()


def measure(kind: str, world: int, args: argparse.Namespace) -> list[tuple[int, int, float, int]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=rank_main, args=(r, world, store, kind, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    model = build(args)
    num_params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters()) * BYTES_PER_PARAM
    total = num_params * BYTES_PER_PARAM
    print(f"model: transformer d_model={args.d_model} layers={args.layers}: {num_params:,} parameters, "
          f"model state {total / 2**20:.1f} MiB ({BYTES_PER_PARAM} B/param), "
          f"one block {block / 2**20:.2f} MiB")
    print("| strategy | world | model state per rank (max) | total / world | target | ok | "
          "peak allocated (GPU) |")
    print("|---|---|---|---|---|---|---|")
    rates: dict[str, float] = {}
    for world in args.worlds:
        for kind in ("ddp", "fsdp"):
            results = measure(kind, world, args)
            per_rank = max(r[1] for r in results)
            target = 1.1 * total / world + block
            ok = "yes" if kind == "ddp" or per_rank <= target else "NO"
            peak = f"{max(r[3] for r in results) / 2**20:.1f} MiB" if args.device == "cuda" else "-"
            print(f"| {kind} | {world} | {per_rank / 2**20:.2f} MiB | {total / world / 2**20:.2f} MiB | "
                  f"{'-' if kind == 'ddp' else f'{target / 2**20:.2f} MiB'} | {ok} | {peak} |")
            if world == 2:
                rates[kind] = min(r[2] for r in results)
    if {"ddp", "fsdp"} <= rates.keys():
        print(f"\nsteps/s at world 2: ddp {rates['ddp']:.2f}, fsdp {rates['fsdp']:.2f} "
              f"(fsdp/ddp = {rates['fsdp'] / rates['ddp']:.2f}x)")


if __name__ == "__main__":
    main()
