"""``bench/reference_gpt.py``, the hand-written loop gpu_check sets beside Switchyard's GPT step,
computes what Switchyard computes: the same per-step losses for the same seed, weights and batches,
on a real one-rank process group. A faster loop that computed something else would prove nothing;
so each check also shows that a reference given another data order or learning rate is caught."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from rank_helpers import one_rank, write_text_dataset

from orchestrator.config import (
    CausalLmTaskConfig,
    CheckpointConfig,
    DataConfig,
    GptConfig,
    LoggerConfig,
    MemoryConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import runtime, trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import reference_gpt

STEPS = 5


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime.Runtime]:
    with one_rank(tmp_path_factory.mktemp("pg")) as rt:
        yield rt


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_text_dataset(tmp_path_factory.mktemp("text"))


def setup(data: str, **changes: object) -> reference_gpt.Setup:
    found = reference_gpt.Setup(data=data, seq_len=16, batch_size=4, d_model=32, num_layers=2, num_heads=2,
                                steps=STEPS, log_every=1, seed=3, device="cpu", amp="none")
    return dataclasses.replace(found, **changes)


def switchyard_losses(rt: runtime.Runtime, ref: reference_gpt.Setup, run: Path) -> list[float]:
    """Each step's loss, as Switchyard logs it (log_every_steps=1: the window is the step)."""
    cfg = TrainConfig(
        model=GptConfig(d_model=ref.d_model, num_heads=ref.num_heads, num_layers=ref.num_layers,
                        compile=ref.compile, compile_backend=ref.compile_backend, compile_scope="model"),
        task=CausalLmTaskConfig(),
        data=DataConfig(path=ref.data, seq_len=ref.seq_len, batch_size=ref.batch_size),
        optim=OptimConfig(max_steps=ref.steps, lr=ref.lr), memory=MemoryConfig(amp=ref.amp), seed=ref.seed,
        checkpoint=CheckpointConfig(async_save=False), log_every_steps=1,
        logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))
    run.mkdir(parents=True)
    torch._dynamo.reset()
    trainer.Trainer(cfg, trainer.DataPaths(train=ref.data, eval=None), run, rt).run()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["train_loss"] for row in rows if "train_loss" in row]


def reference_losses(ref: reference_gpt.Setup) -> list[float]:
    torch._dynamo.reset()
    return reference_gpt.train(ref)["losses"]


def agree(ours: list[float], theirs: list[float], rel: float) -> bool:
    return len(ours) == len(theirs) == STEPS and bool(np.allclose(ours, theirs, rtol=rel, atol=0))


@pytest.mark.parametrize(("changes", "rel"), [
    ({}, 1e-5),  # fp32: the same sums in another order at most
    ({"amp": "bf16"}, 1e-5),  # bf16 autocast on both sides: the same casts, so the same logits
    ({"compile": True, "compile_backend": "aot_eager"}, 1e-5),  # the whole model, compiled, both sides
])
def test_the_reference_computes_switchyards_losses(rank: runtime.Runtime, data: str, tmp_path: Path,
                                                   changes: dict[str, object], rel: float) -> None:
    ref = setup(data, **changes)
    ours = switchyard_losses(rank, ref, tmp_path / "run")
    assert agree(ours, reference_losses(ref), rel), (ours, reference_losses(ref))
    assert ours[-1] < ours[0]  # it trains: equal losses of a frozen model would prove little
    # the check is not blind: another learning rate from the second step on ...
    assert not agree(ours, reference_losses(dataclasses.replace(ref, lr=ref.lr * 0.5)), rel)


def test_a_reference_reading_other_batches_is_caught(rank: runtime.Runtime, data: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ref = setup(data)
    ours = switchyard_losses(rank, ref, tmp_path / "run")
    order = reference_gpt.window_order

    def shifted(*args: int | str) -> Iterator[np.ndarray]:  # every batch's windows one further on
        for windows in order(*args):  # type: ignore[arg-type]
            yield windows + 1

    monkeypatch.setattr(reference_gpt, "window_order", shifted)
    theirs = reference_losses(ref)
    assert len(theirs) == STEPS and not agree(ours, theirs, 1e-5)
    assert abs(theirs[0] / ours[0] - 1) > 1e-4  # from the first step: another batch, not drift


def test_the_reference_follows_the_samplers_order_across_an_epoch(data: str) -> None:
    """An epoch's last batch is short, then the next epoch's order: as Switchyard's loader."""
    windows = reference_gpt.TokenWindows(reference_gpt.open_dataset(data), "tokens", 16)
    steps = -(-len(windows) // 4) + 2  # into the second epoch
    batches = list(reference_gpt.window_order(data, 16, 4, 3, steps))
    first = np.concatenate(batches[:steps - 2])
    assert sorted(first.tolist()) == list(range(len(windows)))  # every window once in the first epoch
    assert len(batches[steps - 3]) == len(windows) % 4 or len(windows) % 4 == 0
    assert len(batches) == steps
