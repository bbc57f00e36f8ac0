"""Every task end to end with real multi-process DDP: a byte-level GPT on real text (the Python
standard library's own sources), exact and elastic resume of a language model, a CNN with pooling
on images, regression, a user's own task, and the refusals before submission."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from train_helpers import refusal, run_train

from sharding import DatasetWriter

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FILES = ["argparse.py", "textwrap.py", "string.py", "json/decoder.py", "json/encoder.py",
               "json/__init__.py", "json/scanner.py", "json/tool.py"]
EVAL_FILES = ["shlex.py", "fnmatch.py"]
GPT = ["task=causal_lm", "model=gpt", "model.d_model=64", "model.num_layers=2", "data.seq_len=64",
       "data.batch_size=16", "optim.lr=3e-3", "logger=jsonl", "log_every_steps=10"]


def run(tmp_path: Path, name: str, *overrides: str, module: str = "jobs.train", env: dict | None = None,  # type: ignore[type-arg]
        ) -> subprocess.CompletedProcess[str]:
    if module == "jobs.train":
        return run_train(*overrides, run_dir=tmp_path / name, env=env)
    return subprocess.run([sys.executable, "-m", module, *overrides], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def summary(run_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The stdlib slice prepared as byte tokens, as a user would with jobs.prepare."""
    root = tmp_path_factory.mktemp("text")
    for part, files in (("train", TRAIN_FILES), ("eval", EVAL_FILES)):
        source = root / f"{part}_src"
        for name in files:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(STDLIB / name, source / name)
        ok(run(root, part, f"input={source}", f"output={root / part}", "format=text", "tokenizer=bytes",
               module="jobs.prepare"))
    return {"train": root / "train", "eval": root / "eval", "train_src": root / "train_src"}


def unigram_entropy_nats(source: Path) -> float:
    counts = Counter(b for path in sorted(source.rglob("*.py")) for b in path.read_bytes())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def test_a_byte_level_gpt_on_the_stdlib_beats_the_unigram_entropy(tmp_path: Path,
                                                                  text: dict[str, Path]) -> None:
    ok(run(tmp_path, "run", *GPT, f"data.path={text['train']}", f"data.eval_path={text['eval']}",
           "optim.max_steps=100"))
    done = summary(tmp_path / "run")
    assert done["world_size"] == 2 and done["unit"] == "tokens"
    assert len(set(done["param_checksum_per_rank"])) == 1
    assert len(set(done["batches_per_rank"])) == 1  # equal window counts on both ranks
    assert done["tokens_per_rank"] == [s * 64 for s in done["samples_per_rank"]]
    entropy = unigram_entropy_nats(text["train_src"])
    assert done["final_eval_loss"] < entropy, (done["final_eval_loss"], entropy)
    assert done["final_eval_metrics"]["eval_perplexity"] == pytest.approx(math.exp(done["final_eval_loss"]))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train_loss" in m]
    assert all(m["tokens_per_s"] > 0 and m["mfu"] is None and m["model_tflops_per_s"] > 0 for m in trained)


def test_a_language_model_resumes_exactly_and_on_another_world_size(tmp_path: Path,
                                                                    text: dict[str, Path]) -> None:
    common = [*GPT, f"data.path={text['train']}", "deterministic=true", "checkpoint.every_steps=15"]
    ok(run(tmp_path, "straight", *common, "optim.max_steps=30"))
    ok(run(tmp_path, "stopped", *common, "optim.max_steps=15"))
    resumed = ok(run(tmp_path, "stopped", *common, "optim.max_steps=30"))
    assert "resumed from" in resumed.stdout
    assert summary(tmp_path / "stopped")["param_checksum_per_rank"] == \
        summary(tmp_path / "straight")["param_checksum_per_rank"]
    stopped, straight = summary(tmp_path / "stopped"), summary(tmp_path / "straight")
    assert stopped["tokens_per_rank"] == straight["tokens_per_rank"]
    assert stopped["samples_per_rank"] == straight["samples_per_rank"]  # since step 0, not the resume
    # world 1 from the world-2 checkpoint at step 15: another run's, so named
    fifteen = tmp_path / "stopped" / "checkpoints" / "step-000000015.pt"
    elastic = ok(run(tmp_path, "elastic", *common, "optim.max_steps=30", "cluster=debug",
                     f"checkpoint.resume_from={fifteen}"))
    assert "at step 15" in elastic.stdout
    done = summary(tmp_path / "elastic")
    assert done["world_size"] == 1 and done["steps"] == 30
    # one definition, since step 0 on either world size (they restarted at 0): the 2 ranks' first 15
    # steps (half of the straight run's), then 15 steps of one rank's batch of 16 windows
    assert done["samples_per_rank"] == [sum(straight["samples_per_rank"]) // 2 + 15 * 16]
    assert done["tokens_per_rank"] == [done["samples_per_rank"][0] * 64]


def test_a_language_model_under_fsdp_bf16_with_checkpointing_and_accumulation(
        tmp_path: Path, text: dict[str, Path]) -> None:
    """The GPT's blocks are the fsdp units; activation checkpointing and accumulation over token
    windows train together on 2 ranks, and both end with the same weights."""
    ok(run(tmp_path, "run", *GPT, f"data.path={text['train']}", "parallelism.strategy=fsdp",
           "memory.amp=bf16", "memory.activation_checkpointing=true", "optim.grad_accum_steps=2",
           "data.batch_size=8", "optim.max_steps=40"))
    done = summary(tmp_path / "run")
    assert len(set(done["param_checksum_per_rank"])) == 1 and done["steps"] == 40
    assert done["tokens_per_rank"] == [s * 64 for s in done["samples_per_rank"]]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["train_loss"] for line in lines if "train_loss" in line]
    assert losses[-1] < 0.8 * losses[0], losses


CNN = '''
import torch
from torch import nn


class SmallCnn(nn.Module):
    """An ordinary CNN: two conv + max-pool stages. A made-up 1x1 input would crash its pooling."""

    def __init__(self, input_shape, num_classes, width=8):
        super().__init__()
        channels = input_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(width * (input_shape[1] // 4) * (input_shape[2] // 4), num_classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TooDeep(SmallCnn):
    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.features = nn.Sequential(*[nn.MaxPool2d(8) for _ in range(3)])
'''

HINGE = '''
import torch
from orchestrator.config import ConfigError
from orchestrator.training.tasks.classify import Classify


class Hinge(Classify):
    """Classify with a multi-class hinge loss instead of cross-entropy, and a margin of its own."""

    def __init__(self, data, margin=1.0):
        super().__init__(data)
        if margin <= 0:
            raise ConfigError(f"task.margin={margin} is invalid: must be > 0 (try task.margin=1.0)")
        self.margin = margin

    def loss_sums(self, output, batch):
        real = ~batch["is_pad"]
        per_sample = torch.nn.functional.multi_margin_loss(
            output.float(), batch[self.target], margin=self.margin, reduction="none") * real
        return per_sample.sum(), real.sum()
'''


def write_images(path: Path, count: int, shape: tuple[int, ...] = (3, 32, 32)) -> None:
    """Two classes a CNN can tell apart: bright top half, or bright bottom half."""
    rng = np.random.default_rng(0)
    with DatasetWriter(path, attributes={"classes": ["top", "bottom"]}) as writer:
        for i in range(count):
            image = rng.integers(0, 60, shape, dtype=np.uint8)
            half = shape[1] // 2
            rows = slice(0, half) if i % 2 == 0 else slice(half, None)
            image[:, rows] += 150
            writer.append({"x": image, "y": np.int64(i % 2)})


@pytest.fixture
def user_code(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "usercode"
    package.mkdir()
    (package / "cnn.py").write_text(CNN)
    (package / "hinge.py").write_text(HINGE)
    return {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def user_code_here(user_code: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[None]:
    """``user_code`` importable in this process, for the refusals checked here; forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m == "usercode" or m.startswith("usercode.")]:
        del sys.modules[name]


def test_a_cnn_with_pooling_trains_on_images_on_two_ranks(tmp_path: Path, user_code: dict[str, str]) -> None:
    """Before: settle ran the model on zeros(1, 1, in_features) and every rank crashed in MaxPool."""
    write_images(tmp_path / "images", 256)
    ok(run(tmp_path, "run", "model=custom", "model._target_=usercode.cnn.SmallCnn",
           f"data.path={tmp_path / 'images'}", f"data.eval_path={tmp_path / 'images'}", "optim.max_steps=30",
           "data.batch_size=16", "logger=jsonl", "log_every_steps=10", env=user_code))
    done = summary(tmp_path / "run")
    assert done["world_size"] == 2 and len(set(done["param_checksum_per_rank"])) == 1
    assert done["final_eval_metrics"]["eval_accuracy"] > 0.9  # num_classes came from the dataset


def test_a_model_that_cannot_take_the_data_is_refused_before_submission(
        tmp_path: Path, user_code_here: None) -> None:
    write_images(tmp_path / "images", 8, shape=(1, 8, 8))
    refused = refusal("model=custom", "model._target_=usercode.cnn.TooDeep",
                      f"data.path={tmp_path / 'images'}")
    assert ("model._target_='usercode.cnn.TooDeep' fails on one real batch of data.path "
            "(x: uint8[8, 1, 8, 8]") in refused  # all 8 images, below batch_size 32


def test_a_users_own_task_trains_and_is_checked_before_submission(
        tmp_path: Path, user_code: dict[str, str], user_code_here: None) -> None:
    write_images(tmp_path / "images", 128)
    task = ["task=custom", "task._target_=usercode.hinge.Hinge", "model=custom",
            "model._target_=usercode.cnn.SmallCnn", f"data.path={tmp_path / 'images'}",
            "data.batch_size=16", "optim.max_steps=20"]
    assert "task.margin=-1 is invalid: must be > 0" in refusal(*task, "+task.margin=-1")
    ok(run(tmp_path, "run", *task, "+task.margin=0.5", env=user_code))
    done = summary(tmp_path / "run")
    assert done["task"] == "Hinge" and done["steps"] == 20 and len(set(done["param_checksum_per_rank"])) == 1


def test_regression_on_float_targets(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(6, 2)).astype(np.float32)
    with DatasetWriter(tmp_path / "reg") as writer:
        for _ in range(512):
            x = rng.normal(size=(int(rng.integers(1, 6)), 6)).astype(np.float32)
            writer.append({"x": x, "y": (x.mean(axis=0) @ weights).astype(np.float32)})
    ok(run(tmp_path, "run", "task=regress", f"data.path={tmp_path / 'reg'}",
           f"data.eval_path={tmp_path / 'reg'}", "optim.max_steps=60", "data.batch_size=32",
           "logger=jsonl", "log_every_steps=10"))
    done = summary(tmp_path / "run")
    metrics = done["final_eval_metrics"]
    assert set(metrics) == {"eval_loss", "eval_mse", "eval_mae"}
    baseline = float(np.mean(np.square(weights)) / 3)  # predicting 0 costs about this much
    assert metrics["eval_mse"] < 0.5 * baseline, (metrics, baseline)


@pytest.mark.parametrize(("overrides", "message"), [
    (["task=causal_lm", "model=gpt"], "task.field='tokens' is invalid for data.path: "),
    (["task=regress"], "data.target_field='y' is invalid: task=regress needs a float target of one "
                       "fixed shape, and data.path="),
    (["data.input_field=y"], "data.input_field='y' is invalid: "),
])
def test_refusals_name_the_field_the_dtype_the_shape_and_a_fix(tmp_path: Path, overrides: list[str],
                                                                message: str) -> None:
    write_images(tmp_path / "images", 8, shape=(4, 3))
    refused = refusal(f"data.path={tmp_path / 'images'}", *overrides)
    assert message in refused
    assert "x: uint8[4, 3]" in refused or "y: int64[]" in refused


def test_classify_refuses_token_data_naming_the_task_that_fits(tmp_path: Path, text: dict[str, Path]) -> None:
    refused = refusal(f"data.path={text['train']}", "data.input_field=tokens", "data.num_classes=2")
    assert "data.target_field='y' is invalid: data.path=" in refused
    assert "is token data with no class field (fields: tokens: uint16[None]); a language model on it: " \
        "task=causal_lm model=gpt" in refused
