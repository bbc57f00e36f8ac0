"""A requeue in the middle of a logging window: the line at the window's end is the mean over all
of its steps, as an uninterrupted run logs it (issue: the step-35 line read 1.397610 after a
requeue where an uninterrupted run reads 1.397371, the mean of the steps after the resume only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rank_helpers import write_rows_dataset

from orchestrator.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    MlpConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import preemption, runtime, trainer


def config(dataset: str, run_dir: Path) -> TrainConfig:
    return TrainConfig(model=MlpConfig(), data=DataConfig(path=dataset, num_classes=3, batch_size=8),
                       optim=OptimConfig(max_steps=10), log_every_steps=10,
                       checkpoint=CheckpointConfig(dir=str(run_dir / "checkpoints")),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def logged(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_window_open_at_a_requeue_is_logged_whole(rank: runtime.Runtime, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = write_rows_dataset(tmp_path / "data", 256, features=5, classes=3, max_rows=6)
    paths = trainer.DataPaths(train=dataset, eval=None)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight.mkdir()
    stopped.mkdir()  # Hydra makes a run's directory before it starts
    trainer.Trainer(config(dataset, straight), paths, straight, rank).run()

    first = trainer.Trainer(config(dataset, stopped), paths, stopped, rank)
    step = first.optimizer_step

    def signalled_at_step_4(*args: Any, **kwargs: Any) -> Any:
        if first.step == 3:
            first.stop.request(preemption.StopReason.PREEMPTED)  # SIGTERM's handler does this
        return step(*args, **kwargs)

    monkeypatch.setattr(first, "optimizer_step", signalled_at_step_4)
    with pytest.raises(preemption.JobStopped):
        first.run()
    assert first.saved_step == 5 and not (stopped / "metrics.jsonl").exists()  # mid-window
    trainer.Trainer(config(dataset, stopped), paths, stopped, rank).run()

    [whole], [resumed] = logged(straight), logged(stopped)
    assert resumed["step"] == whole["step"] == 10
    assert resumed["train_loss"] == whole["train_loss"]
