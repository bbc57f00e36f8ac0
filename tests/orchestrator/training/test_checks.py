"""The model check before submission: one real batch through the model and the task's loss on the
meta device, and on the CPU for a model that reads a value on the host (which meta cannot run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rank_helpers import write_rows_dataset

from orchestrator.config import (
    ConfigError,
    DataConfig,
    LoggerConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import checks, runtime, trainer
from orchestrator.training.tasks import build_task
from sharding import DatasetWriter, open_dataset


def check(model: str, dataset: str) -> None:
    cfg = TrainConfig(model={"_target_": model, "hidden_dim": 8},
                      data=DataConfig(path=dataset, num_classes=3))
    task, ds = build_task(cfg.task, cfg.data), open_dataset(dataset)
    task.setup(ds)
    checks.check_model(cfg, task, ds)


def test_a_model_that_reads_the_host_is_checked_on_the_cpu(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A model above ``HOST_EXAMPLE_MAX`` runs on meta first; one that cannot falls back to two
    samples on the CPU (here the limit is 0, so the test's small model takes that path)."""
    monkeypatch.setattr(checks, "HOST_EXAMPLE_MAX", 0)
    dataset = write_rows_dataset(tmp_path / "rows", 8, features=5, classes=3, max_rows=4)
    check("model_helpers.ReadsTheHost", dataset)  # meta cannot run it; the CPU can, and it fits
    with pytest.raises(ConfigError, match=r"model._target_='model_helpers.ReadsTheHostThenBreaks' fails "
                                          r"on one real batch of data.path \(x: float32\[2, \d, 5\]"):
        check("model_helpers.ReadsTheHostThenBreaks", dataset)


def test_a_small_model_runs_the_whole_example_batch_on_the_host(tmp_path: Path) -> None:
    """Below ``HOST_EXAMPLE_MAX`` the batch of ``data.batch_size`` runs with real weights on the
    host, never on meta, whose first call costs a second of imports: the host-reading model passes
    at once, and a shape error names the whole batch."""
    dataset = write_rows_dataset(tmp_path / "rows", 8, features=5, classes=3, max_rows=4)
    check("model_helpers.ReadsTheHost", dataset)
    with pytest.raises(ConfigError, match=r"model._target_='model_helpers.ReadsTheHostThenBreaks' fails "
                                          r"on one real batch of data.path \(x: float32\[8, \d, 5\]"):
        check("model_helpers.ReadsTheHostThenBreaks", dataset)


def write_images(path: Path, count: int) -> str:
    """uint8 [3, 32, 32] images of two classes: bright top half, or bright bottom half."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path, attributes={"classes": ["top", "bottom"]}) as writer:
        for i in range(count):
            image = rng.integers(0, 60, (3, 32, 32), dtype=np.uint8)
            (image[:, :16] if i % 2 == 0 else image[:, 16:])[...] += 150
            writer.append({"x": image, "y": np.int64(i % 2)})
    return str(path)


def test_a_resnet_with_batchnorm_after_pooling_is_accepted_and_trains(
        rank: runtime.Runtime, tmp_path: Path) -> None:
    """It was refused: the check ran one sample in train mode, and BatchNorm over the pooled
    features raised "Expected more than 1 value per channel when training"."""
    dataset = write_images(tmp_path / "images", 32)
    cfg = TrainConfig(model={"_target_": "model_helpers.TinyResNet"},
                      data=DataConfig(path=dataset, eval_path=dataset, batch_size=8),
                      optim=OptimConfig(max_steps=12, lr=0.05), logger=LoggerConfig(tensorboard=False),
                      telemetry=TelemetryConfig(enabled=False))
    paths = trainer.DataPaths(dataset, dataset)
    checks.check_before_submit(cfg, paths)
    (tmp_path / "run").mkdir()
    summary = trainer.Trainer(cfg, paths, tmp_path / "run", rank).run()
    assert summary["steps"] == 12 and summary["final_eval_metrics"]["eval_accuracy"] > 0.9


def test_any_exception_the_model_raises_is_one_refusal_naming_its_type(tmp_path: Path) -> None:
    """An AttributeError (an HF output's missing .float()) was a Hydra traceback: five exception
    types were caught, and a sixth went through."""
    dataset = write_rows_dataset(tmp_path / "rows", 8, features=5, classes=3, max_rows=4)
    with pytest.raises(ConfigError, match=r"^model._target_='model_helpers.RaisesSomethingNew' fails on "
                                          r"one real batch of data.path \(x: float32\[8, \d, 5\].*\): "
                                          r"StrangeError: the model's own complaint \(fix the model"):
        check("model_helpers.RaisesSomethingNew", dataset)
