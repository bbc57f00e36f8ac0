"""Metrics where ML engineers look: TensorBoard's own reader and W&B's offline run agree with
metrics.jsonl, a run resumed after kill -9 shows every step once, and sweep points are separate runs."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_helpers import run_train, train_command

from orchestrator.launch import local_jobs
from orchestrator.training.run_log import wandb_id

SMALL = ["data.demo_num_samples=512", "data.batch_size=16", "telemetry.enabled=false"]


def train(tmp_path: Path, run: str, *overrides: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    return run_train(*SMALL, *overrides, cache_dir=tmp_path / "cache", run_dir=tmp_path / run, env=env)


def jsonl(run_dir: Path, key: str) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(line["step"], line[key]) for line in lines if key in line]


def tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """The scalars as TensorBoard shows them (its reader applies purge_step as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(
        abs(x - y) <= 1e-6 * max(1.0, abs(x)) for (_, x), (_, y) in zip(a, b, strict=True))


def test_tensorboard_holds_every_logged_value_once_equal_to_metrics_jsonl(tmp_path: Path) -> None:
    proc = train(tmp_path, "run", "optim.max_steps=30", "log_every_steps=5", "eval_every_steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    for key, tag in (("train_loss", "train/loss"), ("samples_per_s", "train/samples_per_s"),
                     ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("peak_mem_bytes", "memory/peak_bytes"), ("eval_loss", "eval/loss"),
                     ("eval_accuracy", "eval/accuracy")):
        logged = jsonl(run, key)
        assert logged and close(tensorboard(run, tag), logged), key
    assert [s for s, _ in jsonl(run, "train_loss")] == [5, 10, 15, 20, 25, 30]
    assert [s for s, _ in jsonl(run, "eval_loss")] == [10, 20, 30]
    assert all(0.9 < a <= 1.0 for _, a in jsonl(run, "eval_accuracy")[-1:])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    hparams = events.PluginTagToContent("hparams")
    assert b"optim.lr" in b"".join(hparams.values())  # the config, for the HParams view


def kill_at_step(tmp_path: Path, run: str, step: int, *overrides: str) -> None:
    """Start a long run and kill -9 the submitter and every rank once it logged ``step``."""
    run_dir = tmp_path / run
    proc = subprocess.Popen(
        train_command(*SMALL, "optim.max_steps=100000", *overrides, cache_dir=tmp_path / "cache",
                      run_dir=run_dir),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not any(s >= step for s, _ in _safe_jsonl(run_dir)):
            assert time.monotonic() < deadline and proc.poll() is None, "the run never got there"
            time.sleep(0.05)
    finally:
        for log in (run_dir / "submitit").glob("*_0_log.out"):
            local_jobs.kill(int(log.name.split("_")[0]))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _safe_jsonl(run_dir: Path) -> list[tuple[int, float]]:
    try:
        return jsonl(run_dir, "train_loss")
    except (OSError, ValueError):
        return []


def test_a_run_resumed_after_kill_9_shows_each_step_once(tmp_path: Path) -> None:
    """Steps the killed attempt logged after its last checkpoint are not repeated: metrics.jsonl and
    TensorBoard show each step once, with the values of the attempt the checkpoints continue."""
    common = ["log_every_steps=1", "checkpoint.every_steps=10", "deterministic=true"]
    kill_at_step(tmp_path, "run", 25, *common)
    killed = jsonl(tmp_path / "run", "train_loss")
    assert max(s for s, _ in killed) >= 25  # steps past the checkpoint at 20 were logged
    proc = train(tmp_path, "run", "optim.max_steps=40", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    steps = [s for s, _ in jsonl(tmp_path / "run", "train_loss")]
    assert steps == list(range(1, 41)), steps
    assert close(tensorboard(tmp_path / "run", "train/loss"), jsonl(tmp_path / "run", "train_loss"))
    straight = train(tmp_path, "straight", "optim.max_steps=40", *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert close(jsonl(tmp_path / "run", "train_loss"), jsonl(tmp_path / "straight", "train_loss"))


def wandb_records(run_dir: Path) -> Iterator[tuple[str, Any]]:
    """Every record of the W&B offline runs in ``run_dir`` (its .wandb files are a LevelDB-style log
    of protobuf records, which `wandb sync` uploads): (record type, record)."""
    from wandb.proto import wandb_internal_pb2

    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""  # ":W&B", magic, version
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):  # full, or last of several
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                yield record.WhichOneof("record_type"), record


def test_wandb_offline_holds_the_config_and_the_history_and_a_resume_continues_it(
        tmp_path: Path) -> None:
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    common = ["logger=wandb", "log_every_steps=5", "checkpoint.every_steps=10"]
    assert train(tmp_path, "run", "optim.max_steps=10", *common, env=env).returncode == 0
    proc = train(tmp_path, "run", "optim.max_steps=20", *common, env=env)  # continues in place
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_ids, steps, config = set(), [], set()
    for kind, record in wandb_records(tmp_path / "run"):
        if kind == "run":
            run_ids.add(record.run.run_id)
            config |= {item.key for item in record.run.config.update}
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                steps.append(items["_step"])
    assert run_ids == {wandb_id(tmp_path / "run")}  # both attempts: one run
    assert {"optim.lr", "data.batch_size", "parallelism.nodes"} <= config, sorted(config)[:20]
    assert steps == [5, 10, 15, 20]


def test_sweep_points_are_separate_tensorboard_runs(tmp_path: Path) -> None:
    proc = run_train("optim.lr=0.001,0.003", "optim.max_steps=10", *SMALL,
                     "hydra.launcher.registry=" + str(tmp_path / "registry.db"),
                     cache_dir=tmp_path / "cache", sweep_dir=tmp_path / "sweep", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.parent for p in (tmp_path / "sweep").glob("*/tensorboard"))
    assert len(runs) == 2
    assert [tensorboard(r, "train/lr")[0][1] for r in runs] == pytest.approx([0.001, 0.003])
