"""The checkpoint is assembled from components that save and restore themselves (``train_state``),
and its layout on disk is the one earlier Switchyards wrote: a checkpoint written by hand in that
layout, and one from before the micro-batcher and the open metrics window were kept, both resume,
the first bit-identically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
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
from orchestrator.training import checkpoint, preemption, runtime, trainer

# What every checkpoint has held since the per-rank windows (the old trainer's train_state).
LAYOUT = {"step", "schedule", "scaler", "sampler", "per_rank", "compat", "world_size", "micro_batch",
          "provenance", "optim", "model", "optimizer"}
RANK_LAYOUT = {"rng", "samples", "units", "batches", "window"}


def config(dataset: str, run_dir: Path) -> TrainConfig:
    return TrainConfig(model=MlpConfig(), data=DataConfig(path=dataset, num_classes=3, batch_size=8),
                       optim=OptimConfig(max_steps=10, schedule="cosine", warmup_steps=2), log_every_steps=4,
                       checkpoint=CheckpointConfig(dir=str(run_dir / "checkpoints")),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def preempted_during_step_5(rank: runtime.Runtime, cfg: TrainConfig, paths: trainer.DataPaths, run: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Path:
    first = trainer.Trainer(cfg, paths, run, rank)
    step = first.optimizer_step

    def signalled_in_step_5(*args: Any, **kwargs: Any) -> Any:
        if first.step == 4:
            first.stop.request(preemption.StopReason.PREEMPTED)  # SIGTERM's handler does this
        return step(*args, **kwargs)

    monkeypatch.setattr(first, "optimizer_step", signalled_in_step_5)
    with pytest.raises(preemption.JobStopped):
        first.run()
    return checkpoint.path_for(run / "checkpoints", 6)  # the ranks read the flag a step later


def written_by_hand(state: dict[str, Any], older: bool) -> dict[str, Any]:
    """The old trainer's ``train_state()`` and ``SingleFile.save``, key by key. ``older``: as
    written before the micro-batcher's record and the per-rank window and units existed."""
    kept = RANK_LAYOUT - {"units", "window"} if older else RANK_LAYOUT
    per_rank = [{key: r[key] for key in kept} for r in state["per_rank"]]
    hand = {"step": state["step"], "schedule": state["schedule"], "scaler": state["scaler"],
            "sampler": state["sampler"], "per_rank": per_rank, "compat": state["compat"],
            "world_size": state["world_size"], "provenance": state["provenance"], "optim": state["optim"],
            "model": state["model"], "optimizer": state["optimizer"]}
    return hand if older else {**hand, "micro_batch": None}


@pytest.mark.parametrize("older", [False, True])
def test_a_checkpoint_in_the_old_layout_resumes(rank: runtime.Runtime, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, older: bool) -> None:
    dataset = write_rows_dataset(tmp_path / "data", 128, features=5, classes=3, max_rows=6)
    paths = trainer.DataPaths(train=dataset, eval=None)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight.mkdir()
    stopped.mkdir()  # Hydra makes a run's directory before it starts
    whole = trainer.Trainer(config(dataset, straight), paths, straight, rank).run()

    saved = preempted_during_step_5(rank, config(dataset, stopped), paths, stopped, monkeypatch)
    state = torch.load(saved, map_location="cpu", weights_only=False)
    assert set(state) == LAYOUT and {frozenset(r) for r in state["per_rank"]} == {frozenset(RANK_LAYOUT)}
    checkpoint.save(saved.parent, 6, written_by_hand(state, older), keep_last=2)  # replaces it

    resumed = trainer.Trainer(config(dataset, stopped), paths, stopped, rank).run()
    assert resumed["resumed_from"]["step"] == 6 and resumed["steps"] == 10
    assert resumed["param_checksum_per_rank"] == whole["param_checksum_per_rank"]
    assert resumed["samples_per_rank"] == whole["samples_per_rank"]
    if not older:  # the open window (steps 5-8) was kept: the loss logged at its end is the whole window's
        assert logged(stopped)[8] == logged(straight)[8]


def logged(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {line["step"]: line["train_loss"] for line in map(json.loads, lines) if "train_loss" in line}
