"""What explaining a failure costs a training step: PyTorch's flight recorder and the slow-rank
notes, on against off.

Every rank keeps the recorder on (``orchestrator/launch/hang_dumps.py``): each collective is one
entry in a ring buffer. Every rank also notes when its batches are in hand, and all-gathers the
notes in the metrics window's CPU collective at log steps (``orchestrator/training/stragglers.py``;
both sides run that collective, as the trainer does). This runs the same DDP step (a model
with several gradient buckets, so several all-reduces a step) in 2 gloo ranks with both on and
with both off, alternating, in one run, and prints the ratio. The heartbeat's side (one ``stat``
per beat, on its own thread) is not on the step's path. Target: under 1 % (ratio >= 0.99).

    python bench/hang_dump_bench.py                    # 2 ranks, 200 steps, 3 pairs
    python bench/hang_dump_bench.py --device cuda --world 1    # on a GPU node: NCCL's recorder
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from orchestrator.training import runtime
from orchestrator.training.stragglers import Lateness


def one_rank(rank: int, args: argparse.Namespace, recorder: bool, port: int,
             out: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.pop(name, None)
    if recorder:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=device)
    rt = SimpleNamespace(env=SimpleNamespace(world_size=args.world, rank=rank, hostname="bench"),
                         is_main=rank == 0)
    notes = Lateness(rt, Path(args.tmp), fraction=0.25, windows=3) if recorder else None  # type: ignore[arg-type]
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        if notes is not None:
            notes.enter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if (step + 1) % args.log_every == 0:  # a log step: the window's CPU collective, as the trainer's
            payload = notes.payload() if notes is not None else None
            runtime.global_max(rt, 0, payload)  # type: ignore[arg-type]
            if notes is not None:
                notes.take(payload)
    if cuda:
        torch.cuda.synchronize()
    if rank == 0:
        out.put(args.steps / (time.perf_counter() - start))
    dist.destroy_process_group()


def steps_per_s(args: argparse.Namespace, recorder: bool, port: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=one_rank, args=(r, args, recorder, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    rate = float(out.get(timeout=600))
    for p in procs:
        p.join(60)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    args.tmp = tempfile.mkdtemp()
    rates: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(args.pairs):
        for recorder in ((False, True) if pair % 2 == 0 else (True, False)):  # alternate the order
            rates[recorder].append(steps_per_s(args, recorder, 29400 + 2 * pair + recorder))
    on, off = max(rates[True]), max(rates[False])
    print(f"both off: {off:.1f} steps/s (best of {args.pairs}: {[round(r, 1) for r in rates[False]]})")
    print(f"both on:  {on:.1f} steps/s (best of {args.pairs}: {[round(r, 1) for r in rates[True]]})")
    print(f"ratio on/off: {on / off:.3f} (target >= 0.99)")


if __name__ == "__main__":
    main()
