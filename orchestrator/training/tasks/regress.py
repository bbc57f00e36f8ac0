"""``task=regress``: a float target of any fixed shape per sample, mean squared error; MSE and
MAE in evaluation. The model gets ``num_outputs`` (the target's element count) and returns
``[batch, num_outputs]`` or ``[batch, *target shape]``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from orchestrator.config import ConfigError, DataConfig
from orchestrator.training.tasks import Batch, Task, field_of, real_mask, sample_shape
from orchestrator.training.tasks.classify import SampleInput
from sharding import ShardedDataset


class Regress(Task):
    def __init__(self, data: DataConfig) -> None:
        super().__init__(data)
        self.input = SampleInput(data, "task=regress", "predictions [B, num_outputs]")
        self.target = data.target_field

    def setup(self, ds: ShardedDataset) -> None:
        self.input.setup(ds)

    def check_dataset(self, key: str, ds: ShardedDataset) -> None:
        self.input.check(key, ds)
        spec = field_of(key, ds, "data.target_field", self.target)
        if not spec.dtype.startswith("float") or None in sample_shape(ds, self.target):
            raise ConfigError(f"data.target_field={self.target!r} is invalid: task=regress needs a "
                              f"float target of one fixed shape, and {key}={str(ds.root)!r} has "
                              f"{self.target}: {spec} (an integer class: task=classify)")

    def model_kwargs(self, ds: ShardedDataset) -> dict[str, Any]:
        shape = sample_shape(ds, self.target)
        return {**self.input.model_kwargs(ds), "num_outputs": math.prod(int(d or 0) for d in shape)}

    def fields(self) -> tuple[str, ...]:
        return (*self.input.fields(), self.target, "is_pad")

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        return self.input.forward(model, batch)

    def errors(self, output: Tensor, batch: Batch) -> Tensor:
        """float32 [B, elements]: prediction minus target, per element of each sample's target."""
        target = batch[self.target].float().reshape(len(output), -1)
        return output.float().reshape(len(output), -1) - target

    def loss_sums(self, output: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        real = real_mask(batch)
        per_sample = self.errors(output, batch).square().mean(dim=1) * real  # [B]
        return per_sample.sum(), real.sum()

    def eval_sums(self, output: Tensor, batch: Batch) -> Tensor:
        real = real_mask(batch)
        errors = self.errors(output, batch)
        squared = (errors.square().mean(dim=1) * real).sum()
        absolute = (errors.abs().mean(dim=1) * real).sum()
        return torch.stack([squared.double(), real.sum().double(), absolute.double()])

    def eval_metrics(self, sums: Any) -> dict[str, float]:
        return {"eval_loss": sums[0] / sums[1], "eval_mse": sums[0] / sums[1],
                "eval_mae": sums[2] / sums[1]}
