"""Models for the tests, importable by ``model._target_`` (tests/ is on the path): for the
pre-submission model check, models that read a value on the host, which the meta device cannot
run; for ``memory.auto_microbatch``, one that runs out of memory above a batch size."""

from __future__ import annotations

from typing import Any

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
