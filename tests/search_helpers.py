"""A task whose best learning rate is known, for the search's tests (importable by ``_target_``).

The model is one scalar ``w`` (``Scalar``, starting at ``w0``); the loss is ``curvature / 2 * w^2``
whatever the batch (``Quadratic``). Plain SGD (``optim=sgd optim.momentum=0``) steps
``w <- w - lr * curvature * w``, so after ``n`` steps ``w = (1 - lr * curvature)^n * w0``: the
loss is 0 after one step at ``lr = 1 / curvature`` and falls more slowly on either side of it; at
``lr >= 2 / curvature`` it grows without bound (NaN soon after). With the default curvature 4 the
optimum is lr = 0.25, and any lr within 2x of it (0.125 to 0.5) ends far lower than one outside.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import Tensor, nn

from orchestrator.config import DataConfig
from orchestrator.training.tasks import Batch, Task

OPTIMUM_LR = 0.25  # 1 / Quadratic's default curvature


class Scalar(nn.Module):
    """``delay_s``: each forward sleeps this long, so a trial lasts long enough for the controller
    to see its eval windows while it runs (the maths takes microseconds). ``spread``: the delay is
    scaled by a factor from 0.5 to 1.5 that differs from process to process (taken from the pid),
    so trials started together do not all end together, as real trials do not."""

    def __init__(self, w0: float = 1.0, delay_s: float = 0.0, spread: bool = False, **_: Any) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(float(w0)))
        self.delay_s = delay_s * (0.5 + os.getpid() % 1000 / 1000 if spread else 1.0)

    def forward(self, *_: Any) -> Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.w


class Quadratic(Task):
    """``curvature / 2 * w^2`` per micro-batch, counted as one unit (so DDP's mean and the
    micro-batch split leave the gradient ``curvature * w`` exactly)."""

    def __init__(self, data: DataConfig, curvature: float = 4.0) -> None:
        super().__init__(data)
        self.curvature = curvature

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        return model()

    def loss_sums(self, output: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        return 0.5 * self.curvature * output.float().square(), torch.ones((), device=output.device)

    def denominator(self, batch_size: int) -> float:
        return 1.0
