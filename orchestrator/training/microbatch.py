"""``memory.auto_microbatch``: a step that runs out of memory runs again in smaller pieces.

The loader keeps producing batches of ``data.batch_size``; each is cut into pieces of the current
micro-batch size, so a step trains on exactly the samples it would have, in the same order, and
the loss keeps the task's fixed denominator (``Task.denominator(data.batch_size)`` x the loaded
batches): half the micro-batch and twice the accumulation give the same gradient.

Why every piece runs without DDP's reduction (``no_sync``), and the gradients are all-reduced once
after the backward: DDP launches a bucket's all-reduce as soon as its gradients are ready, from
inside backward. A rank that runs out of memory half way through backward has launched some
buckets and not the others, and its reducer still expects the rest; the ranks that did not OOM
wait for collectives that never come (NCCL: forever). Without any collective inside forward and
backward an OOM can strike anywhere and leaves nothing in flight.

All ranks agree before any of them retries: after the backward each rank sets its slot of a CPU
tensor (1: out of memory) and the tensor is summed over the process group's gloo side (a GPU run's
group is ``cpu:gloo,cuda:nccl``). The flag comes from a Python exception, not from a device value,
so agreeing needs no host-device sync; a rank that did not OOM waits here instead of in NCCL.

The cost, with ``memory.auto_microbatch=true`` only: one small gloo all-reduce per step (the ranks
meet on the host once per step), and the gradient all-reduce no longer overlaps the backward.
``fsdp`` gathers parameters inside forward and backward, so an OOM there would still leave the
other ranks waiting: it is refused before submission (``TrainConfig``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from orchestrator.training import estimate
from orchestrator.training.runtime import Runtime

Batch = dict[str, torch.Tensor]
BUCKET_BYTES = 25 << 20  # DDP's default bucket: one all-reduce per 25 MiB of gradients


class MicroBatchError(RuntimeError):
    """A step ran out of memory at a micro-batch of 1: there is nothing left to halve."""


def pieces(batch: Batch, size: int) -> list[Batch]:
    """``batch`` cut into consecutive pieces of at most ``size`` entries (the last may be shorter:
    the fixed denominator makes unequal pieces exact). Values not of the batch's length (none
    today) pass whole into every piece."""
    count = len(batch["is_pad"])
    if count <= size:
        return [batch]
    return [{k: v[start:start + size] if len(v) == count else v for k, v in batch.items()}
            for start in range(0, count, size)]


def ranks_out_of_memory(rt: Runtime, out_of_memory: bool) -> list[int]:
    """The ranks whose step ran out of memory, the same list on every rank: one CPU tensor summed
    over gloo (a collective every rank reaches, whether it OOMed or not)."""
    flags = torch.zeros(rt.env.world_size, dtype=torch.int64)  # CPU: rides gloo, never the GPU stream
    flags[rt.env.rank] = int(out_of_memory)
    dist.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def all_reduce_gradients(module: nn.Module, world_size: int) -> None:
    """DDP's reduction, run once after the pieces' backward: every gradient divided by the world
    size, then summed over ranks, in 25 MiB buckets of one dtype. A parameter without a gradient
    gets zeros, so every rank flattens the same tensors (DDP would refuse an unused parameter)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for p in params:
        grad = p.grad
        assert grad is not None  # set above
        chain = buckets.setdefault((grad.device, grad.dtype), [[]])
        if chain[-1] and sum(g.numel() * g.element_size() for g in chain[-1]) >= BUCKET_BYTES:
            chain.append([])
        chain[-1].append(grad)
    for chain in buckets.values():
        for grads in chain:
            flat = _flatten_dense_tensors(grads)
            flat.div_(world_size)
            dist.all_reduce(flat)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(reduced)


def broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, once per step: what DDP's
    ``broadcast_buffers`` does at each synchronised forward, which ``no_sync`` skips."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def free(device: torch.device) -> None:
    """Give back what the failed attempt held: its tensors (kept alive by reference cycles through
    the exception's frames until collected) and, on a GPU, the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class AutoMicroBatch:
    """The micro-batch size a rank's steps run at, halved when a step runs out of memory on any rank,
    and the record of each change (``changes``: metrics.jsonl, summary.json, the checkpoint)."""

    def __init__(self, rt: Runtime, batch_size: int, grad_accum_steps: int, run_dir: Path) -> None:
        self.rt, self.run_dir = rt, run_dir
        self.batch_size, self.grad_accum_steps = batch_size, grad_accum_steps  # what the loader makes
        self.size = batch_size
        self.changes: list[dict[str, Any]] = []
        self.unlogged: list[dict[str, Any]] = []  # changes rank 0 has not written to metrics.jsonl yet

    @property
    def accumulation(self) -> int:
        """Pieces per optimizer step: what ``optim.grad_accum_steps`` would be at this micro-batch."""
        return self.grad_accum_steps * -(-self.batch_size // self.size)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's record: what the summary shows. A resume starts at the micro-batch the
        run had come down to."""
        return self.as_summary()

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """A checkpoint's record (``state_dict``; None: written without auto_microbatch, or before
        it existed). The size is kept below this run's ``data.batch_size``."""
        if saved is not None:
            self.size = max(1, min(int(saved["micro_batch_size"]), self.batch_size))
            self.changes = list(saved["changes"])

    def step(self, number: int, batches: list[Batch], backward: Callable[[list[Batch]], torch.Tensor],
             discard: Callable[[], None], module: nn.Module) -> torch.Tensor:
        """``backward`` over ``batches`` cut into pieces (no reduction inside), until every rank got
        through it; then the gradients are reduced. ``discard``: drop a failed attempt's gradients.
        ``number``: the step being run (1-based), for the record."""
        while True:
            try:
                sums: torch.Tensor | None = backward([p for b in batches for p in pieces(b, self.size)])
                failed = False
            except torch.OutOfMemoryError:
                sums, failed = None, True
            ranks = ranks_out_of_memory(self.rt, failed)
            if not ranks:
                assert sums is not None  # no rank failed, this one included
                all_reduce_gradients(module, self.rt.env.world_size)
                broadcast_buffers(module)
                return sums
            sums = None
            discard()
            free(self.rt.device)
            self.halve(number, ranks)

    def halve(self, number: int, ranks: list[int]) -> None:
        if self.size == 1:
            raise MicroBatchError(self.give_up(number, ranks))
        change = {"step": number, "micro_batch_size": self.size // 2, "from": self.size, "ranks": ranks}
        self.size //= 2
        change["accumulation"] = self.accumulation
        self.changes.append(change)
        self.unlogged.append(change)
        if self.rt.is_main:
            print(f"memory: step {number} ran out of memory on rank(s) {ranks} at micro-batch "
                  f"{change['from']}; retrying at {self.size} ({self.accumulation} pieces per step, "
                  f"the same samples and gradient; memory.auto_microbatch=true)", flush=True)

    def give_up(self, number: int, ranks: list[int]) -> str:
        report = estimate.read_report(self.run_dir) or {}
        found, capacity = report.get("estimate_bytes"), report.get("capacity_bytes")
        if found:
            of = f" of {estimate.gib(capacity)} on {report.get('capacity_name')}" if capacity else ""
            said = f"the estimate before submission was {estimate.gib(found['peak'])} peak per rank{of}"
        else:
            why = report.get("unavailable") or "memory.estimate=off, or not run"
            said = f"there is no estimate from before submission ({why})"
        return (f"step {number} ran out of memory on rank(s) {ranks} at a micro-batch of 1 "
                f"(data.batch_size={self.batch_size}, memory.auto_microbatch=true): nothing is left to "
                f"halve; {said}, and one sample does not fit. Try memory.amp=bf16, "
                f"memory.activation_checkpointing=true, parallelism.strategy=fsdp, a smaller model, "
                f"or a GPU with more memory (python -m jobs.train cluster.dry_run=true shows the "
                f"estimate's table)")

    def as_summary(self) -> dict[str, Any]:
        return {"micro_batch_size": self.size, "batch_size": self.batch_size,
                "accumulation": self.accumulation, "changes": self.changes}
