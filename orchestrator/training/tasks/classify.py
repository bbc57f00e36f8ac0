"""``task=classify``: an integer class per sample, cross-entropy, accuracy. Any input shape.

An input of ``[rows, features]`` (the built-in models' contract) is called as ``model(x, mask)``,
with an all-true mask where the rows are stacked; any other input (images ``[C, H, W]``, a flat
``[features]``, token ids) as ``model(x)``, or ``model(x, mask)`` where its leading size varies.
uint8 inputs (images) arrive as float in [0, 1], other integers (token ids) as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orchestrator.config import ConfigError, DataConfig
from orchestrator.training.tasks import (
    Batch,
    Task,
    attributes,
    describe_fields,
    field_of,
    logits_of,
    model_input,
    real_mask,
    sample_shape,
)
from sharding import DatasetError, ShardedDataset


class SampleInput:
    """How a task that reads one input field per sample calls the model (classify, regress)."""

    def __init__(self, data: DataConfig, task: str, needs: str) -> None:
        self.field = data.input_field
        self.task, self.needs = task, needs  # for the refusal of an output with no logits
        self.rows_features = True  # set from the dataset by ``setup``

    def setup(self, ds: ShardedDataset) -> None:
        spec = ds.schema.get(self.field)
        self.rows_features = spec is not None and len(spec.shape) == 2

    def check(self, key: str, ds: ShardedDataset) -> None:
        spec = field_of(key, ds, "data.input_field", self.field)
        if spec.shape == () or spec.dtype == "bool":
            raise ConfigError(f"data.input_field={self.field!r} is invalid: {key}={str(ds.root)!r} has "
                              f"{self.field}: {spec}, and a model input must be a numeric array of one "
                              f"or more dimensions (prepare it so, or choose another field)")

    def model_kwargs(self, ds: ShardedDataset) -> dict[str, Any]:
        spec = ds.schema[self.field]
        if len(spec.shape) == 2:
            return {"in_features": int(spec.shape[-1] or 0)}
        return {"input_shape": sample_shape(ds, self.field)}

    def fields(self) -> tuple[str, ...]:
        return self.field, f"{self.field}_mask"

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        x = model_input(batch[self.field])
        mask = batch.get(f"{self.field}_mask")
        if self.rows_features and mask is None:  # stacked rows: every row is real
            mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        return logits_of(model(x) if mask is None else model(x, mask), self.task, self.needs)


class Classify(Task):
    def __init__(self, data: DataConfig) -> None:
        super().__init__(data)
        self.input = SampleInput(data, "task=classify", "logits [B, num_classes]")
        self.target = data.target_field
        self.num_classes = data.num_classes

    def setup(self, ds: ShardedDataset) -> None:
        self.input.setup(ds)

    def classes(self, ds: ShardedDataset) -> int:
        """data.num_classes, or the class count the dataset records (an image folder's), or the
        demo dataset's."""
        if self.num_classes:
            return self.num_classes
        recorded = attributes(ds).get("classes")
        if isinstance(recorded, list) and len(recorded) >= 2:
            return len(recorded)
        if self.data.path is None:
            return self.data.demo_classes
        raise ConfigError(f"data.num_classes is needed with data.path={self.data.path!r} (the model's "
                          f"output size; the dataset records no class list{self._label_hint(ds)}")

    def _label_hint(self, ds: ShardedDataset) -> str:
        """The end of the message above: the class count the labels need, where they can be read."""
        try:
            lo, hi = ds.value_range(self.target)
        except DatasetError:  # no such field, not an integer, or no samples: checked elsewhere
            return "): set data.num_classes=<the number of classes>"
        if lo < 0:
            return f"; its labels in {self.target!r} are {lo}..{hi}, and must be >= 0): relabel the dataset"
        return f"; its labels in {self.target!r} go up to {hi}): try data.num_classes={max(hi + 1, 2)}"

    def check_dataset(self, key: str, ds: ShardedDataset) -> None:
        if "tokenizer" in attributes(ds) and self.target not in ds.schema:
            raise ConfigError(f"data.target_field={self.target!r} is invalid: {key}={str(ds.root)!r} is "
                              f"token data with no class field (fields: {describe_fields(ds)}); a "
                              f"language model on it: task=causal_lm model=gpt")
        self.input.check(key, ds)
        spec = field_of(key, ds, "data.target_field", self.target)
        if spec.shape != () or "int" not in spec.dtype:
            raise ConfigError(f"data.target_field={self.target!r} is invalid: task=classify needs an "
                              f"integer class per sample, and {key}={str(ds.root)!r} has {self.target}: "
                              f"{spec} (a float target: task=regress)")
        try:
            lo, hi = ds.value_range(self.target)
        except DatasetError as e:  # an older dataset is scanned: a damaged shard shows here
            raise ConfigError(f"{key}={str(ds.root)!r} cannot be read: {e}") from e
        classes = self.classes(ds)
        where = f"{key}={str(ds.root)!r} has labels {lo}..{hi} in {self.target!r}"
        if lo < 0:
            raise ConfigError(f"{where}: class indices must be >= 0 (relabel the dataset)")
        if hi >= classes:
            option = "data.num_classes" if self.num_classes or self.data.path else "data.demo_classes"
            raise ConfigError(f"{option}={classes} is invalid: {where}, so the model needs at least "
                              f"{hi + 1} classes (try {option}={hi + 1})")

    def model_kwargs(self, ds: ShardedDataset) -> dict[str, Any]:
        return {**self.input.model_kwargs(ds), "num_classes": self.classes(ds)}

    def fields(self) -> tuple[str, ...]:
        return (*self.input.fields(), self.target, "is_pad")

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        return self.input.forward(model, batch)

    def loss_sums(self, output: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        real = real_mask(batch)
        per_sample = F.cross_entropy(output.float(), batch[self.target], reduction="none") * real
        return per_sample.sum(), real.sum()

    def eval_sums(self, output: Tensor, batch: Batch) -> Tensor:
        total, count = self.loss_sums(output, batch)
        correct = ((output.argmax(-1) == batch[self.target]) & real_mask(batch)).sum()
        return torch.stack([total.double(), count.double(), correct.double()])

    def eval_metrics(self, sums: Any) -> dict[str, float]:
        return {"eval_loss": sums[0] / sums[1], "eval_accuracy": sums[2] / sums[1]}
