"""``model=gpt`` as ``GPT2LMHeadModel`` (orchestrator/export/gpt2.py): the same logits in fp32,
within 1e-5, straight after the mapping and after save_pretrained/from_pretrained; the same
parameter count; and what GPT-2 cannot represent refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from jobs.models import GPT
from orchestrator.export import gpt2
from orchestrator.export.source import ExportError

transformers = pytest.importorskip("transformers")


def trained_like(**sizes: int) -> GPT:
    """A GPT whose every weight is random and far from its initialisation (biases and norms too),
    so a mapping that drops or mis-transposes a tensor shows in the logits."""
    torch.manual_seed(0)
    model = GPT(vocab_size=61, seq_len=12, **sizes)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def logits_both(model: GPT, hf: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens), hf(input_ids=tokens).logits


@pytest.mark.parametrize("sizes", [{"d_model": 32, "num_heads": 4, "num_layers": 2},
                                   {"d_model": 24, "num_heads": 3, "num_layers": 1, "ff_mult": 2}])
def test_gpt_logits_match_gpt2lmheadmodel_within_1e_5_in_fp32(tmp_path: Path, sizes: dict[str, int]) -> None:
    model = trained_like(**sizes)
    hf = gpt2.convert(model)
    ours, theirs = logits_both(model, hf)
    assert (ours - theirs).abs().max() <= 1e-5
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    ours, theirs = logits_both(model, loaded)
    assert (ours - theirs).abs().max() <= 1e-5
    # the head stays tied to the embedding: one matrix, counted once on both sides
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())


def test_exact_gelu_is_gelu_and_the_tanh_approximation_is_gelu_new() -> None:
    model = trained_like(d_model=16, num_heads=2, num_layers=2)
    assert gpt2.config(model).activation_function == "gelu"
    for block in model.blocks:
        block.mlp[1] = nn.GELU(approximate="tanh")
    hf = gpt2.convert(model)
    assert hf.config.activation_function == "gelu_new"
    ours, theirs = logits_both(model, hf)
    assert (ours - theirs).abs().max() <= 1e-5


def test_the_wrong_activation_would_show_in_the_logits() -> None:
    """The comparison has the power to catch a mapping error: GPT-2's own default activation
    (tanh-approximated) instead of the exact GELU moves the logits by far more than 1e-5."""
    model = trained_like(d_model=16, num_heads=2, num_layers=2)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **{**gpt2.config(model).to_dict(), "activation_function": "gelu_new"})).eval()
    hf.load_state_dict(gpt2.state_dict(model), strict=False)
    ours, theirs = logits_both(model, hf)
    assert (ours - theirs).abs().max() > 1e-4


class Wider(GPT):
    pass


def test_what_gpt2_cannot_represent_is_refused_naming_it() -> None:
    with pytest.raises(ExportError, match=r"subclass of GPT .*use --format safetensors"):
        gpt2.config(Wider(vocab_size=10, seq_len=4, d_model=8, num_heads=2, num_layers=1))
    model = trained_like(d_model=16, num_heads=2, num_layers=1)
    model.norm.eps = 1e-6
    with pytest.raises(ExportError, match=r"LayerNorms have different epsilons"):
        gpt2.config(model)
    model = trained_like(d_model=16, num_heads=2, num_layers=1)
    model.blocks[0].mlp[1] = nn.ReLU()
    with pytest.raises(ExportError, match=r"activation is ReLU"):
        gpt2.config(model)
