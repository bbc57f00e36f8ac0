"""Every guarantee of the trainer, per task: k accumulated micro-batches equal one k-times larger
batch (samples for classify and regress, tokens for causal_lm), padding entries count nowhere,
activation checkpointing leaves gradients alone, and throughput is never a made-up ratio."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from rank_helpers import one_rank
from torch import nn

from jobs.models import GPT, RowPoolingMLP
from orchestrator.config import DataConfig
from orchestrator.training import runtime, step
from orchestrator.training.tasks.causal_lm import CausalLm
from orchestrator.training.tasks.classify import Classify
from orchestrator.training.tasks.regress import Regress
from orchestrator.training.throughput import peak_tflops, throughput_for

Batch = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime.Runtime]:
    with one_rank(tmp_path_factory.mktemp("pg")) as rt:
        yield rt


def token_batch(seed: int, size: int, seq_len: int = 6, pad_last: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (size, seq_len + 1), generator=g)
    is_pad = torch.zeros(size, dtype=torch.bool)
    is_pad[-1] = pad_last
    return {"input": tokens[:, :-1], "target": tokens[:, 1:], "is_pad": is_pad, "index": torch.arange(size)}


def regress_batch(seed: int, size: int, pad_last: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    is_pad = torch.zeros(size, dtype=torch.bool)
    is_pad[-1] = pad_last
    return {"x": torch.randn(size, 4, 5, generator=g), "y": torch.randn(size, 2, generator=g),
            "is_pad": is_pad, "index": torch.arange(size)}


def concat(batches: list[Batch]) -> Batch:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


CASES = {
    "causal_lm": (lambda: GPT(vocab_size=11, seq_len=6, d_model=16, num_heads=2, num_layers=2),
                  lambda: CausalLm(DataConfig(seq_len=6)), token_batch),
    "regress": (lambda: RowPoolingMLP(in_features=5, num_outputs=2),
                lambda: Regress(DataConfig()), regress_batch),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch(
        single_rank: runtime.Runtime, case: str) -> None:
    make_model, make_task, make_batch = CASES[case]
    torch.manual_seed(0)
    base, task = make_model(), make_task()
    accumulated = runtime.wrap(copy.deepcopy(base), single_rank)
    big = runtime.wrap(copy.deepcopy(base), single_rank)
    micro = [make_batch(1, 4), make_batch(2, 4, pad_last=True), make_batch(3, 4)]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    small_sums = step.backward_micro_batches(accumulated, micro, task, 4, "none", scaler)
    big_sums = step.backward_micro_batches(big, [concat(micro)], task, 12, "none", scaler)
    for g_acc, g_big in zip(grads(accumulated), grads(big), strict=True):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(small_sums, big_sums)
    expected_units = 11 * 6 if case == "causal_lm" else 11  # 12 entries, one of them padding
    assert small_sums[1].item() == expected_units and small_sums[2].item() == 11


@pytest.mark.parametrize("case", sorted(CASES))
def test_padding_entries_count_nowhere(case: str) -> None:
    make_model, make_task, make_batch = CASES[case]
    torch.manual_seed(0)
    model, task = make_model(), make_task()
    batch = make_batch(4, 4, pad_last=True)
    changed = {k: v.clone() for k, v in batch.items()}
    target = "target" if case == "causal_lm" else "y"
    changed[target][-1] = (changed[target][-1] + 1) % 11 if case == "causal_lm" else changed[target][-1] + 9
    with torch.no_grad():
        total, count = task.loss_sums(task.forward(model, batch), batch)
        total_changed, _ = task.loss_sums(task.forward(model, changed), changed)
    assert float(total) == pytest.approx(float(total_changed))
    assert int(count) == (3 * 6 if case == "causal_lm" else 3)


def test_the_fixed_denominator_is_the_tasks_unit() -> None:
    """Tokens for a language model (batch x seq_len), samples otherwise: a window's loss is per
    token, never divided by the batch size."""
    assert CausalLm(DataConfig(seq_len=128)).denominator(32) == 32 * 128
    assert Regress(DataConfig()).denominator(32) == 32
    assert Classify(DataConfig()).denominator(32) == 32  # Task's default: the batch's samples


def test_tf32_is_set_on_gpu_ranks_only() -> None:
    """memory.tf32 (default true): torch leaves cuBLAS's TF32 off, so fp32 GEMMs on an A100 or H100
    ran at plain FP32 speed. A CPU rank keeps torch's settings (they also steer oneDNN)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        runtime.set_tf32(torch.device("cpu"), True)
        assert not torch.backends.cuda.matmul.allow_tf32
        runtime.set_tf32(torch.device("cuda", 0), True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        runtime.set_tf32(torch.device("cuda", 0), False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_gpt_activation_checkpointing_leaves_gradients_unchanged() -> None:
    torch.manual_seed(0)
    plain = GPT(vocab_size=11, seq_len=6, d_model=16, num_heads=2, num_layers=2)
    recomputed = copy.deepcopy(plain)
    recomputed.enable_activation_checkpointing()
    task, batch = CausalLm(DataConfig(seq_len=6)), token_batch(5, 3)
    for model in (plain, recomputed):
        total, count = task.loss_sums(task.forward(model, batch), batch)
        (total / count).backward()
    for a, b in zip(grads(plain), grads(recomputed), strict=True):
        torch.testing.assert_close(a, b)


def test_gpt_ties_its_head_to_the_embedding_and_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=11, seq_len=6, d_model=16, num_heads=2, num_layers=2).eval()
    assert model.head.weight is model.embed.weight
    tokens = token_batch(6, 2)["input"]
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11  # only the last position differs
    torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_mfu_is_null_where_the_peak_is_unknown_never_a_made_up_ratio() -> None:
    model = GPT(vocab_size=11, seq_len=6, d_model=16, num_heads=2, num_layers=2)
    measured = throughput_for(model, torch.device("cpu"), "bf16", world_size=2)(1e6)
    assert measured["mfu"] is None
    assert measured["model_tflops_per_s"] == pytest.approx(model.flops_per_token() * 1e6 / 1e12)
    plain = RowPoolingMLP(in_features=5, num_classes=3)
    assert throughput_for(plain, torch.device("cpu"), "none", 1)(1e6) == {}
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "none") == 19.5
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "none", tf32=True) == 156.0
    assert peak_tflops("Tesla T4", "bf16") is None
