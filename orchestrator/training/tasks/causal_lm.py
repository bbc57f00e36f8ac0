"""``task=causal_lm``: next-token prediction over fixed windows of ``data.seq_len + 1`` tokens
packed across documents (``sharding.windows``). The loss is per token, in nats, over every
position; the fixed denominator is ``batch_size x seq_len`` tokens, so accumulation is exact. The
model gets ``vocab_size`` and ``seq_len`` and maps int64 ``[batch, seq_len]`` to logits
``[batch, seq_len, vocab]``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orchestrator.config import ConfigError, DataConfig
from orchestrator.training.tasks import (
    Batch,
    Task,
    accepts,
    attributes,
    describe_fields,
    logits_of,
    real_mask,
)
from sharding import DatasetError, ShardedDataset
from sharding.windows import TokenWindows


class CausalLm(Task):
    unit = "tokens"

    def __init__(self, data: DataConfig, field: str = "tokens", vocab_size: int | None = None) -> None:
        super().__init__(data)
        self.field, self.seq_len, self.vocab_size = field, data.seq_len, vocab_size
        if vocab_size is not None and vocab_size < 2:
            raise ConfigError(f"task.vocab_size={vocab_size} is invalid: must be >= 2 "
                              f"(or null: the dataset's tokenizer says)")

    def vocabulary(self, key: str, ds: ShardedDataset) -> int:
        if self.vocab_size is not None:
            return self.vocab_size
        tokenizer = attributes(ds).get("tokenizer")
        if isinstance(tokenizer, dict) and isinstance(tokenizer.get("vocab_size"), int):
            return int(tokenizer["vocab_size"])
        raise ConfigError(f"{key}={str(ds.root)!r} records no tokenizer, so its vocabulary size is "
                          f"unknown: set task.vocab_size=N (every token id must be < N), or prepare "
                          f"it with python -m jobs.prepare format=text")

    def windows(self, key: str, ds: ShardedDataset) -> TokenWindows:
        try:
            return TokenWindows(ds, self.field, self.seq_len)
        except DatasetError as e:
            raise ConfigError(f"task.field={self.field!r} is invalid for {key}: {e} (fields: "
                              f"{describe_fields(ds)})") from e

    def check_dataset(self, key: str, ds: ShardedDataset) -> None:
        windows = self.windows(key, ds)
        self.check_ids(key, ds, windows)
        if windows.num_windows < 1:
            raise ConfigError(f"data.seq_len={self.seq_len} is invalid: {key}={str(ds.root)!r} holds "
                              f"{windows.num_tokens} tokens, fewer than one window of seq_len + 1 "
                              f"(try data.seq_len={max(windows.num_tokens - 1, 1)})")

    def check_ids(self, key: str, ds: ShardedDataset, windows: TokenWindows) -> None:
        """Every token id is below the vocabulary: an id beyond the embedding was an IndexError
        on every rank. The largest id is the one ``jobs.prepare`` records, else read from the
        shards; a recorded tokenizer alone is trusted (its ids are below its size)."""
        vocabulary = self.vocabulary(key, ds)
        recorded = attributes(ds).get("max_token_id")
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            largest = recorded
        elif self.vocab_size is not None:
            largest = windows.largest_id()
        else:
            return
        if largest >= vocabulary:
            given = (f"task.vocab_size={vocabulary}" if self.vocab_size is not None else
                     f"task.vocab_size=null (the {vocabulary} ids of the tokenizer {key} records)")
            raise ConfigError(f"{given} is invalid: {key}={str(ds.root)!r} has token ids up to "
                              f"{largest} in {self.field!r}, so the model needs a vocabulary of at "
                              f"least {largest + 1} (try task.vocab_size={largest + 1})")

    def model_kwargs(self, ds: ShardedDataset) -> dict[str, Any]:
        return {"vocab_size": self.vocabulary("data.path", ds), "seq_len": self.seq_len}

    def source(self, ds: ShardedDataset) -> TokenWindows:
        return self.windows("data.path", ds)

    def fields(self) -> tuple[str, ...]:
        return "input", "target", "is_pad"

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        """``model(input)``, or ``model(input_ids=input)`` where forward names ``input_ids`` (a
        Hugging Face causal LM), with an all-true ``attention_mask`` where it names one: packed
        windows hold no padding, and a padded entry of the sampler is masked out of the loss."""
        inputs = batch["input"]
        # DDP's own forward takes *args, **kwargs: the wrapped model's says what it names
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if accepts(module, "input_ids"):
            mask = {"attention_mask": torch.ones_like(inputs)} if accepts(module, "attention_mask") else {}
            output = model(input_ids=inputs, **mask)
        else:
            output = model(inputs)
        return logits_of(output, "task=causal_lm", "logits [B, L, V]")

    def loss_sums(self, output: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        tokens = real_mask(batch).unsqueeze(1).expand_as(batch["target"])  # bool [B, L]
        per_token = F.cross_entropy(output.float().flatten(0, 1), batch["target"].flatten(),
                                    reduction="none")  # [B * L]
        return (per_token * tokens.flatten()).sum(), tokens.sum()

    def denominator(self, batch_size: int) -> float:
        return float(batch_size * self.seq_len)

    def eval_metrics(self, sums: Any) -> dict[str, float]:
        loss = sums[0] / sums[1]
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
