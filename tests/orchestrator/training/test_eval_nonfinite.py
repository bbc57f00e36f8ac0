"""An evaluation that gives NaN or infinity fails the run, naming the eval set, the metric and the
step (issue 34 item 5). Before, a regression eval set with one NaN target ended as a success:
``final_eval_loss: null`` and ``eval_mse: null`` in summary.json, rc 0, and no word of why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestrator.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    MlpConfig,
    OptimConfig,
    RegressTaskConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import runtime, trainer
from orchestrator.training.nonfinite import NonFiniteEvalError
from sharding import DatasetWriter


def regression_rows(path: Path, count: int, nan_at: int | None = None) -> str:
    """``x: float32[rows, 4]``, ``y: float32[2]``; sample ``nan_at``'s target holds a NaN."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path) as writer:
        for i in range(count):
            y = rng.normal(size=2).astype(np.float32)
            if i == nan_at:
                y[1] = np.nan
            writer.append({"x": rng.normal(size=(int(rng.integers(1, 4)), 4)).astype(np.float32), "y": y})
    return str(path)


def config(train: str, eval_path: str, run: Path, eval_every_steps: int) -> TrainConfig:
    return TrainConfig(model=MlpConfig(), task=RegressTaskConfig(),
                       data=DataConfig(path=train, eval_path=eval_path, batch_size=4),
                       optim=OptimConfig(max_steps=4), log_every_steps=2, eval_every_steps=eval_every_steps,
                       checkpoint=CheckpointConfig(every_steps=0),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


@pytest.mark.parametrize("eval_every_steps", [0, 2])
def test_a_nan_target_in_the_eval_set_fails_the_run_naming_the_set_the_metric_and_the_step(
        rank: runtime.Runtime, tmp_path: Path, eval_every_steps: int) -> None:
    train = regression_rows(tmp_path / "train", 32)
    bad_eval = regression_rows(tmp_path / "eval", 12, nan_at=7)
    run = tmp_path / "run"
    run.mkdir()
    cfg = config(train, bad_eval, run, eval_every_steps)
    paths = trainer.DataPaths(train=train, eval=bad_eval)
    step = eval_every_steps or 4  # the first evaluation: periodic, or the one at the end
    with pytest.raises(NonFiniteEvalError) as failed:
        trainer.Trainer(cfg, paths, run, rank).run()
    message = str(failed.value)
    assert f"evaluation at step {step} gave eval_loss=nan" in message, message
    assert "eval_mse=nan" in message and f"data.eval_path={bad_eval!r}" in message, message
    assert "\n" not in message
    assert not (run / "summary.json").exists()
    # the training itself was sound: the step the evaluation stopped at is checkpointed
    assert (run / "checkpoints" / f"step-{step:09d}.pt").exists(), sorted((run / "checkpoints").iterdir())


def test_a_finite_eval_set_still_completes(rank: runtime.Runtime, tmp_path: Path) -> None:
    train = regression_rows(tmp_path / "train", 32)
    run = tmp_path / "run"
    run.mkdir()
    summary = trainer.Trainer(config(train, train, run, 0), trainer.DataPaths(train=train, eval=train),
                              run, rank).run()
    assert summary["final_eval_loss"] is not None and summary["final_eval_metrics"]["eval_mse"] is not None
