"""Models for the tests, importable by ``model._target_`` (tests/ is on the path): for the
pre-submission model check, models that read a value on the host, which the meta device cannot
run; for ``memory.auto_microbatch``, one that runs out of memory above a batch size."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from jobs.models import RowPoolingMLP, masked_mean


class ReadsTheHost(RowPoolingMLP):
    """Fine on real data: an ``if`` on a tensor's value, as many user models have."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if bool(mask.any()):
            return super().forward(x, mask)
        return super().forward(x, mask.logical_not())


class ReadsTheHostThenBreaks(ReadsTheHost):
    """Reads the host, then feeds its head the wrong width: a shape error on every rank."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if bool(mask.any()):
            return self.head(x)  # x is [B, L, features], the head takes hidden_dim
        return super().forward(x, mask)


class OutOfMemoryAbove(RowPoolingMLP):
    """Raises ``torch.OutOfMemoryError``, as the CUDA allocator does, on a batch of more than
    ``max_batch`` entries in training: in forward, or half way through backward (after the head's
    gradients, before the embedding's), on the ranks in ``ranks`` (empty: every rank)."""

    def __init__(self, max_batch: int, ranks: list[int] | None = None, where: str = "forward",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_batch, self.ranks, self.where = max_batch, list(ranks or []), where

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        here = not self.ranks or dist.get_rank() in self.ranks
        too_big = self.training and len(x) > self.max_batch and here
        if too_big and self.where == "forward":
            raise torch.OutOfMemoryError(f"test: a batch of {len(x)} > {self.max_batch}")
        pooled = masked_mean(self.embed(x), mask)  # [B, H]
        if too_big:
            pooled = _FailsInBackward.apply(pooled)
        return self.head(self.run_blocks(pooled))  # [B, C]


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise torch.OutOfMemoryError("test: out of memory in backward")


class TinyResNet(torch.nn.Module):
    """resnet18's shape in small: conv-BatchNorm stem, one residual block, global pooling, then a
    BatchNorm over the pooled features (one value per channel per sample: a batch of one in train
    mode raises "Expected more than 1 value per channel when training"), then the head."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.pooled_norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        pooled = torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)  # [B, width]
        return self.head(self.pooled_norm(pooled))


class RaisesSomethingNew(RowPoolingMLP):
    """Raises an exception type no check names, as a model's own code may."""

    class StrangeError(Exception):
        pass

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        raise RaisesSomethingNew.StrangeError("the model's own complaint")


class OutputAs(torch.nn.Module):
    """A built-in model (``inner``: its dotted name) whose output is handed back as ``kind``: a
    ``dict``, a ``dataclass`` or a ``namedtuple`` with ``logits`` (as Hugging Face models return),
    or a plain ``tuple`` of three, which no task can read."""

    def __init__(self, kind: str, inner: str, **kwargs: Any) -> None:
        super().__init__()
        from orchestrator.config import import_target

        self.kind, self.inner = kind, import_target("model", inner, "")(**kwargs)

    def forward(self, *args: Tensor) -> Any:
        logits = self.inner(*args)
        if self.kind == "dict":
            return {"loss": None, "logits": logits}
        if self.kind == "dataclass":
            return WithLogits(logits=logits, hidden=None)
        if self.kind == "namedtuple":
            return NamedLogits(logits, logits.detach())
        return (logits, logits, logits)


@dataclasses.dataclass
class WithLogits:
    logits: Tensor
    hidden: Tensor | None


class NamedLogits(NamedTuple):
    logits: Tensor
    detached: Tensor


class HoldsAModule(torch.nn.Module):
    """A wrapper whose forward takes ``tokens`` and holds, as ``self.module``, a model whose forward
    names ``input_ids``: only DDP's ``.module`` says what the called model takes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.module = TakesInputIds(**kwargs)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.module(input_ids=tokens)


class TakesInputIds(torch.nn.Module):
    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.embed(input_ids)


class SlowToBuildOnRank1(RowPoolingMLP):
    """Rank 1 builds it ``SLOW_BUILD_S`` late, as a rank whose imports or checkpoint load lag
    (a shared file system): its rank 0 waits that long in DDP's first broadcast."""

    SLOW_BUILD_S = 8.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(self.SLOW_BUILD_S)
        super().__init__(*args, **kwargs)


class CountsForwards(RowPoolingMLP):
    """A model that counts its forwards (``calls``), for one that misbehaves at a given call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0


class StuckOnRank1(CountsForwards):
    """From its ``STUCK_AT``-th forward on, rank 1 spins in Python (``spin_in_python``): alive, its
    heartbeat beating on at the same step as rank 0, which waits in the gradients' all-reduce."""

    STUCK_AT = 4

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls >= self.STUCK_AT:
            spin_in_python()
        return super().forward(x, mask)


def spin_in_python() -> None:
    while True:
        time.sleep(0.05)


class SkipsACollectiveOnRank1(StuckOnRank1):
    """At its ``STUCK_AT``-th forward, rank 1 enters a broadcast the other ranks never call: from
    there, the ranks' collectives no longer pair up."""

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls == self.STUCK_AT:
            dist.broadcast(torch.zeros(3), src=0)
        return RowPoolingMLP.forward(self, x, mask)


class SlowDataOnRank1:
    """A task's own view of the dataset (``Task.source``) whose batches rank 1 reads ``SLOW_S``
    late: a slow data path (a loaded file system, a starved loader) on one rank."""

    SLOW_S = 0.15

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shard_counts = inner.dataset.shard_counts

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, values: Any) -> Any:
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(self.SLOW_S)
        return self.inner.__getitems__(values)


class FailsOnRank1(CountsForwards):
    """Rank 1's ``FAILS_AT``-th forward raises, the same way at every start: the code's own bug."""

    FAILS_AT = 3

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and self.calls == self.FAILS_AT:
            raise ValueError("the model's own bug, at the same step every time")
        return super().forward(x, mask)
