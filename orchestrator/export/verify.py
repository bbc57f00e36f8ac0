"""Every export reloaded and compared with the checkpoint it came from, on a fixed batch: the
logits within ``TOLERANCE`` (fp32, on the host) and the same number of parameters. What was
compared goes into the export's ``export.json``; a mismatch publishes nothing.

The batch is made from what the model took from the dataset (``resume.model_of``), seeded, so it
is the same for every export of a run: token ids ``[2, min(seq_len, 32)]`` for a language model,
rows ``[2, 4, in_features]`` with a mask, or images ``[2, *input_shape]``. A model of the user's
own that takes none of these is compared weight for weight only, and export.json says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from orchestrator.training.tasks import accepts, logits_of

TOLERANCE = 1e-4  # max |difference| of fp32 logits: the same arithmetic, other kernels or order
_SEED = 1234


@dataclass(frozen=True)
class Batch:
    call: Callable[[nn.Module], Tensor]  # the model -> its logits on the batch
    shape: list[int]


def fixed_batch(dataset_kwargs: dict[str, Any]) -> Batch | None:
    generator = torch.Generator().manual_seed(_SEED)
    if "vocab_size" in dataset_kwargs:
        length = min(int(dataset_kwargs.get("seq_len") or 32), 32)
        tokens = torch.randint(0, int(dataset_kwargs["vocab_size"]), (2, length), generator=generator)
        return Batch(lambda model: _tokens(model, tokens), list(tokens.shape))
    if "in_features" in dataset_kwargs:
        x = torch.randn(2, 4, int(dataset_kwargs["in_features"]), generator=generator)
        mask = torch.ones(2, 4, dtype=torch.bool)
        return Batch(lambda model: _logits(model(x, mask)), list(x.shape))
    if "input_shape" in dataset_kwargs:
        x = torch.rand(2, *map(int, dataset_kwargs["input_shape"]), generator=generator)
        return Batch(lambda model: _logits(model(x)), list(x.shape))
    return None


def _tokens(model: nn.Module, tokens: Tensor) -> Tensor:
    if accepts(model, "input_ids"):  # a Hugging Face model, as task=causal_lm calls it
        return _logits(model(input_ids=tokens))
    return _logits(model(tokens))


def _logits(output: Any) -> Tensor:
    return logits_of(output, "switchyard export", "logits").float()


def parameter_count(model: nn.Module) -> int:
    """Each parameter once: a tied head is the embedding's matrix, counted once on both sides."""
    return sum(p.numel() for p in model.parameters())


def compare(original: nn.Module, reloaded: nn.Module, batch: Batch | None,
            exact_weights: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """What export.json records of the comparison; ``passed`` False on any mismatch.
    ``exact_weights``: the reloaded state dict, compared tensor by tensor with ``original``'s
    (safetensors keeps the checkpoint's bytes, so they must be equal)."""
    counts = parameter_count(original), parameter_count(reloaded)
    result: dict[str, Any] = {"parameters": counts[0], "parameters_reloaded": counts[1],
                              "tolerance": TOLERANCE, "batch_shape": batch.shape if batch else None}
    passed = counts[0] == counts[1]
    if exact_weights is not None:
        theirs = original.state_dict()
        differ = [k for k, v in theirs.items() if k not in exact_weights
                  or not torch.equal(v.cpu(), exact_weights[k].to(v.dtype))]
        result["weights_equal"] = not differ
        passed = passed and not differ
    if batch is not None:
        with torch.no_grad():
            ours, loaded = batch.call(original), batch.call(reloaded)
        if ours.shape != loaded.shape:
            result["max_abs_diff"] = None
            result["why"] = f"logits of shape {list(loaded.shape)}, the checkpoint's {list(ours.shape)}"
            passed = False
        else:
            result["max_abs_diff"] = float((ours - loaded).abs().max())
            passed = passed and result["max_abs_diff"] <= TOLERANCE
    else:
        result["max_abs_diff"] = None
        result["why"] = "no fixed batch for this model's inputs: weights compared only"
    result["passed"] = passed
    return result
