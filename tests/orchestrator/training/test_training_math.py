"""Correctness of the memory levers on CPU: accumulation, activation checkpointing, AMP."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rank_helpers import one_rank
from torch import nn

from jobs.models import RowPoolingMLP, RowTransformer
from orchestrator.config import DataConfig, MemoryConfig, OptimConfig, TrainConfig
from orchestrator.training import runtime, step
from orchestrator.training.tasks.classify import Classify
from sharding import collate_padded


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime.Runtime]:
    """A real one-rank gloo process group, so DDP and no_sync run for real."""
    with one_rank(tmp_path_factory.mktemp("pg")) as rt:
        yield rt


def make_batch(seed: int, size: int, pad_last: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    samples = [{"x": torch.randn(int(torch.randint(0, 9, (1,), generator=g)), 5, generator=g),
                "y": torch.randint(0, 3, (), generator=g)} for _ in range(size)]
    batch = collate_padded(samples)
    batch["is_pad"] = torch.zeros(size, dtype=torch.bool)
    batch["is_pad"][-1] = pad_last
    batch["index"] = torch.arange(size)
    return batch


def concat(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows = max(a["x"].shape[1], b["x"].shape[1])

    def pad(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, rows - t.shape[1]))

    out = {k: torch.cat([a[k], b[k]]) for k in ("y", "is_pad", "index", "x_lengths")}
    out["x"] = torch.cat([pad(a["x"]), pad(b["x"])])
    out["x_mask"] = torch.cat([pad(a["x_mask"]), pad(b["x_mask"])])
    return out


def cfg_with(batch_size: int, accum: int, amp: str = "none") -> TrainConfig:
    return TrainConfig(model={}, data=DataConfig(batch_size=batch_size),
                       optim=OptimConfig(grad_accum_steps=accum), memory=MemoryConfig(amp=amp))


CLASSIFY = Classify(DataConfig())


def backward(model: nn.Module, batches: list[dict[str, torch.Tensor]], cfg: TrainConfig,
             scaler: torch.amp.GradScaler) -> torch.Tensor:
    return step.backward_micro_batches(model, batches, CLASSIFY, cfg.data.batch_size, cfg.memory.amp,
                                          scaler)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_cls", [RowPoolingMLP, RowTransformer])
def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch(
        single_rank: runtime.Runtime, model_cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    base = model_cls(in_features=5, num_classes=3)
    accumulated = runtime.wrap(copy.deepcopy(base), single_rank)
    big = runtime.wrap(copy.deepcopy(base), single_rank)
    b1, b2, b3 = make_batch(1, 4), make_batch(2, 4, pad_last=True), make_batch(3, 4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    backward(accumulated, [b1, b2, b3], cfg_with(4, 3), scaler)
    backward(big, [concat(concat(b1, b2), b3)], cfg_with(12, 1), scaler)
    for g_acc, g_big in zip(grads(accumulated), grads(big), strict=True):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-5, atol=1e-6)


def test_padding_entries_contribute_nothing(single_rank: runtime.Runtime) -> None:
    torch.manual_seed(0)
    model = runtime.wrap(RowPoolingMLP(in_features=5, num_classes=3), single_rank)
    batch = make_batch(4, 4, pad_last=True)
    _, total, count = step.batch_loss(model, batch, CLASSIFY, "none", 1.0)
    changed = dict(batch, y=batch["y"].clone())
    changed["y"][-1] = (changed["y"][-1] + 1) % 3  # a different label on the padding entry only
    _, total_changed, _ = step.batch_loss(model, changed, CLASSIFY, "none", 1.0)
    assert int(count) == 3 and float(total) == pytest.approx(float(total_changed))


@pytest.mark.parametrize("model_cls", [RowPoolingMLP, RowTransformer])
def test_activation_checkpointing_leaves_gradients_unchanged(model_cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    plain = model_cls(in_features=5, num_classes=3)
    recomputed = copy.deepcopy(plain)
    recomputed.enable_activation_checkpointing()  # type: ignore[operator]
    batch = make_batch(5, 6)
    for model in (plain, recomputed):
        nn.functional.cross_entropy(model(batch["x"], batch["x_mask"]), batch["y"]).backward()
    for a, b in zip(grads(plain), grads(recomputed), strict=True):
        torch.testing.assert_close(a, b)


def test_padding_rows_do_not_change_the_output() -> None:
    torch.manual_seed(0)
    model = RowTransformer(in_features=5, num_classes=3).eval()
    x = torch.randn(2, 4, 5)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    noisy = x.clone()
    noisy[0, 2:] = 100.0  # garbage in padding rows
    torch.testing.assert_close(model(x, mask), model(noisy, mask))
    assert torch.isfinite(model(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.bool))).all()


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_steps_reduce_the_loss(single_rank: runtime.Runtime, amp: str) -> None:
    torch.manual_seed(0)
    model = runtime.wrap(RowPoolingMLP(in_features=5, num_classes=3), single_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == "fp16")
    batch = make_batch(6, 16)
    cfg = cfg_with(16, 1, amp)
    losses = []
    for _ in range(30):
        total, count, _ = backward(model, [batch], cfg, scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(total / count))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0]


def test_dataparallel_is_unwrapped_with_a_warning(single_rank: runtime.Runtime) -> None:
    inner = RowPoolingMLP(in_features=5, num_classes=3)
    with pytest.warns(UserWarning, match="DataParallel.*GPU 0"):
        wrapped = runtime.wrap(nn.DataParallel(inner), single_rank)
    assert wrapped.module is inner


def test_unknown_model_target_is_a_clear_error() -> None:
    from orchestrator.config import ConfigError

    with pytest.raises(ConfigError, match=r"model._target_='nope.Net' cannot be imported"):
        step.build_model({"_target_": "nope.Net"}, {"in_features": 5, "num_classes": 3}, MemoryConfig())


def test_config_dataclass_roundtrip_is_picklable(tmp_path: Path) -> None:
    import pickle

    cfg = dataclasses.replace(cfg_with(4, 2), model={"_target_": "jobs.models.RowPoolingMLP"})
    assert pickle.loads(pickle.dumps(cfg)) == cfg
