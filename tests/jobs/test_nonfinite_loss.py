"""A loss that turns NaN or infinite stops the run, or skips the step (issue 27 item 2).

Before, a run with a huge learning rate exited 0 with ``final_train_loss: null`` and its newest
checkpoints held NaN weights: the next resume would start from them.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
from train_helpers import run_train

from sharding import DatasetWriter

SMALL = ["data.batch_size=8", "log_every_steps=5", "logger=jsonl", "telemetry.enabled=false"]


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_train(*SMALL, *overrides, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")


def rows_with_one_nan(path: Path, count: int = 64, bad: int = 5) -> Path:
    """``x: float32[rows, 4]``, ``y = i % 3``; sample ``bad`` holds a NaN: its batch's loss is NaN."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path) as writer:
        for i in range(count):
            x = rng.normal(size=(int(rng.integers(1, 6)), 4)).astype(np.float32)
            if i == bad:
                x[0, 0] = np.nan
            writer.append({"x": x, "y": np.int64(i % 3)})
    return path


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in (run / "checkpoints").glob("step-*.pt"))


def test_a_loss_that_turns_nonfinite_stops_naming_the_step_and_checkpoints_nothing_after(
        tmp_path: Path) -> None:
    # the largest learning rate the config takes, with heavy momentum: NaN at step 5 of 10
    proc = train(tmp_path, "optim.name=sgd", "optim.lr=10", "optim.momentum=0.99", "optim.max_steps=10",
                 "checkpoint.every_steps=1", "data.demo_num_samples=256")
    assert proc.returncode != 0, "a run whose loss went NaN must not succeed"
    found = re.search(r"the training loss was NaN or infinite at step (\d+)", proc.stderr)
    assert found, proc.stderr[-3000:]
    bad = int(found.group(1))
    assert checkpoint_steps(tmp_path / "run") and all(s < bad for s in checkpoint_steps(tmp_path / "run")), \
        f"a checkpoint written at or after step {bad}: {checkpoint_steps(tmp_path / 'run')}"
    assert not (tmp_path / "run" / "summary.json").exists()


def test_on_nonfinite_skip_skips_the_bad_steps_and_completes(tmp_path: Path) -> None:
    data = rows_with_one_nan(tmp_path / "data")
    proc = train(tmp_path, f"data.path={data}", "data.num_classes=3", "optim.max_steps=12",
                 "optim.on_nonfinite=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["skipped_nonfinite_steps"]) == 3  # the NaN sample once an epoch, 4 steps each
    assert summary["final_train_loss"] is not None
    assert len(set(summary["param_checksum_per_rank"])) == 1, "the ranks must skip the same steps"
    assert "were skipped (optim.on_nonfinite=skip): steps [" in proc.stderr


def test_the_same_data_stops_by_default(tmp_path: Path) -> None:
    data = rows_with_one_nan(tmp_path / "data")
    proc = train(tmp_path, f"data.path={data}", "data.num_classes=3", "optim.max_steps=12")
    assert proc.returncode != 0
    assert re.search(r"NaN or infinite at step \d+ \(optim.on_nonfinite=stop\)", proc.stderr)
