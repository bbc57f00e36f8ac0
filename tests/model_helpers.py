"""Models for the pre-submission model check, importable by ``model._target_`` (tests/ is on the
path): each reads a value on the host, which the meta device cannot run."""

from __future__ import annotations

from torch import Tensor

from jobs.models import RowPoolingMLP


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
