"""The model check before submission: one real batch through the model and the task's loss on the
meta device, and on the CPU for a model that reads a value on the host (which meta cannot run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_helpers import write_rows_dataset

from orchestrator.config import ConfigError, DataConfig, TrainConfig
from orchestrator.training import checks
from orchestrator.training.tasks import build_task
from sharding import open_dataset


def check(model: str, dataset: str) -> None:
    cfg = TrainConfig(model={"_target_": model, "hidden_dim": 8},
                      data=DataConfig(path=dataset, num_classes=3))
    task, ds = build_task(cfg.task, cfg.data), open_dataset(dataset)
    task.setup(ds)
    checks.check_model(cfg, task, ds)


def test_a_model_that_reads_the_host_is_checked_on_the_cpu(tmp_path: Path) -> None:
    dataset = write_rows_dataset(tmp_path / "rows", 8, features=5, classes=3, max_rows=4)
    check("model_helpers.ReadsTheHost", dataset)  # meta cannot run it; the CPU can, and it fits
    with pytest.raises(ConfigError, match=r"model._target_='model_helpers.ReadsTheHostThenBreaks' fails "
                                          r"on one real batch of data.path \(x: float32\[1, \d, 5\]"):
        check("model_helpers.ReadsTheHostThenBreaks", dataset)
