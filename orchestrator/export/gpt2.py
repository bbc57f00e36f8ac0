"""``model=gpt`` (``jobs.models.GPT``) as a ``transformers.GPT2LMHeadModel``: the same network.

Both are GPT-2's architecture: token and learned position embeddings added, pre-norm blocks
(LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual), a final LayerNorm,
and a bias-free head tied to the token embedding. Attention scales by 1/sqrt(head_dim) in both,
and both split the fused projection into q, k, v in that order, each as [heads, head_dim].

| Switchyard (``jobs.models.GPT``)       | GPT2LMHeadModel                       |
|---------------------------------------|---------------------------------------|
| ``embed``, ``position``               | ``transformer.wte``, ``transformer.wpe`` |
| ``blocks.i.norm1`` / ``norm2``        | ``transformer.h.i.ln_1`` / ``ln_2``   |
| ``blocks.i.qkv`` (Linear, [3D, D])     | ``transformer.h.i.attn.c_attn`` (Conv1D, [D, 3D]: transposed) |
| ``blocks.i.proj``                     | ``transformer.h.i.attn.c_proj`` (transposed) |
| ``blocks.i.mlp.0`` / ``mlp.2``         | ``transformer.h.i.mlp.c_fc`` / ``c_proj`` (transposed) |
| ``norm``                              | ``transformer.ln_f``                  |
| ``head`` (tied to ``embed``)          | ``lm_head`` (tied to ``wte``)         |

Activations: ``nn.GELU()`` (exact, erf) is ``activation_function="gelu"``; ``nn.GELU("tanh")``
would be ``"gelu_new"`` (GPT-2's own default, which Switchyard's GPT does not use). Dropout:
Switchyard's GPT drops only attention weights (``attn_pdrop``), never the residual or the
embeddings (``resid_pdrop=embd_pdrop=0``); at inference neither drops anything.

What GPT2LMHeadModel cannot represent is refused, naming it: a subclass of GPT (its forward may
differ), another activation, LayerNorms of different epsilons, or a parameter the table lacks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from orchestrator.export.source import ExportError

GPT_TARGET = "jobs.models.GPT"
_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_new"}  # nn.GELU(approximate=...) -> transformers' name


def class_path(model: nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def is_gpt(model: nn.Module) -> bool:
    """``model=gpt`` or a subclass (refused by ``config``), found by name: ``jobs`` sits above
    ``orchestrator`` and is not imported from here."""
    return any(f"{c.__module__}.{c.__qualname__}" == GPT_TARGET for c in type(model).__mro__)


def config(model: Any, eos_id: int | None = None) -> Any:
    """The ``GPT2Config`` of ``model``, or an ExportError naming what GPT-2 cannot represent."""
    from transformers import GPT2Config

    refuse = _refusal(model)
    if refuse is not None:
        raise ExportError(f"--format hf: model=gpt cannot be written as GPT2LMHeadModel: {refuse} "
                          f"(use --format safetensors)")
    block: Any = model.blocks[0]
    gelu = block.mlp[1]
    return GPT2Config(
        vocab_size=model.embed.num_embeddings, n_positions=model.seq_len, n_embd=model.embed.embedding_dim,
        n_layer=len(model.blocks), n_head=block.num_heads, n_inner=block.mlp[0].out_features,
        activation_function=_ACTIVATIONS[gelu.approximate], layer_norm_epsilon=model.norm.eps,
        attn_pdrop=block.dropout, resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, architectures=["GPT2LMHeadModel"])


def _refusal(model: Any) -> str | None:
    if class_path(model) != GPT_TARGET:
        return f"{class_path(model)} is a subclass of GPT (its forward may differ)"
    blocks = list(model.blocks)
    norms = [model.norm] + [n for b in blocks for n in (b.norm1, b.norm2)]
    if len({n.eps for n in norms}) > 1:
        return f"its LayerNorms have different epsilons ({sorted({n.eps for n in norms})})"
    gelus = [b.mlp[1] for b in blocks]
    if not all(isinstance(g, nn.GELU) and g.approximate in _ACTIVATIONS for g in gelus):
        return f"its MLP activation is {type(gelus[0]).__name__}, not nn.GELU"
    if len({g.approximate for g in gelus}) > 1:
        return "its blocks use different GELU approximations"
    if model.head.weight is not model.embed.weight:
        return "its head is not tied to the token embedding"
    return None


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under GPT2LMHeadModel's names (Conv1D weights transposed)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        out[_name(name)] = tensor.t().contiguous() if _transposed(name) else tensor
    return out


_BLOCK = {"norm1": "ln_1", "norm2": "ln_2", "qkv": "attn.c_attn", "proj": "attn.c_proj",
          "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}
_TOP = {"embed.weight": "transformer.wte.weight", "position.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
        "head.weight": "lm_head.weight"}


def _name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) >= 4:
        layer, rest, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
        if rest in _BLOCK:
            return f"transformer.h.{layer}.{_BLOCK[rest]}.{leaf}"
    raise ExportError(f"--format hf: model=gpt has a parameter GPT2LMHeadModel lacks: {name} "
                      f"(use --format safetensors)")


def _transposed(name: str) -> bool:
    """Conv1D keeps its weight as [in, out], nn.Linear as [out, in]."""
    parts = name.split(".")
    return parts[0] == "blocks" and parts[-1] == "weight" and ".".join(parts[2:-1]) in (
        "qkv", "proj", "mlp.0", "mlp.2")


def convert(model: nn.Module, eos_id: int | None = None) -> nn.Module:
    """A ``GPT2LMHeadModel`` holding ``model``'s weights, in eval mode."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(config(model, eos_id))
    missing, unexpected = hf.load_state_dict(state_dict(model), strict=False)
    # lm_head.weight is tied to wte, so it may be listed missing; anything else is a real gap
    gaps = [k for k in missing if k != "lm_head.weight"] + list(unexpected)
    if gaps:
        raise ExportError(f"--format hf: model=gpt does not fill GPT2LMHeadModel: {gaps[:5]} "
                          f"(use --format safetensors)")
    return hf.eval()
