"""Any model output in every task (issue 36): a tensor, or a dict, dataclass or namedtuple with
``logits`` (a Hugging Face ``ModelOutput`` is both); anything else is one refusal before
submission naming the type returned and what the task needs. ``causal_lm`` calls a model whose
forward names ``input_ids`` by keyword. The task's own loss stays the loss."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rank_helpers import write_rows_dataset
from train_helpers import CHEAP, run_train

from orchestrator.config import (
    CausalLmTaskConfig,
    ConfigError,
    DataConfig,
    LoggerConfig,
    OptimConfig,
    RegressTaskConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import checks, runtime, trainer
from orchestrator.training.tasks import build_task
from sharding import DatasetWriter, open_dataset

KINDS = ["dict", "dataclass", "namedtuple"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    with DatasetWriter(root / "tokens") as writer:
        for _ in range(8):
            writer.append({"tokens": rng.integers(0, 50, 40).astype(np.uint16)})
    with DatasetWriter(root / "targets") as writer:
        for _ in range(16):
            writer.append({"x": rng.normal(size=(3, 5)).astype(np.float32),
                           "y": rng.normal(size=(2,)).astype(np.float32)})
    return {"classify": write_rows_dataset(root / "rows", 16, features=5, classes=3, max_rows=4),
            "causal_lm": str(root / "tokens"), "regress": str(root / "targets")}


def config(task: str, path: str, model: dict[str, Any], **optim: Any) -> TrainConfig:
    specs = {"classify": {}, "causal_lm": {"task": CausalLmTaskConfig(vocab_size=50)},
             "regress": {"task": RegressTaskConfig()}}
    return TrainConfig(model=model, **specs[task],  # type: ignore[arg-type]
                       data=DataConfig(path=path, num_classes=3, seq_len=8, batch_size=4),
                       optim=OptimConfig(**{"max_steps": 4, **optim}), log_every_steps=1,
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def wrapped(task: str, kind: str) -> dict[str, Any]:
    inner = {"causal_lm": {"inner": "jobs.models.GPT", "d_model": 16, "num_heads": 2, "num_layers": 1}}
    return {"_target_": "model_helpers.OutputAs", "kind": kind,
            **inner.get(task, {"inner": "jobs.models.RowPoolingMLP", "hidden_dim": 8})}


def check(cfg: TrainConfig) -> None:
    task, ds = build_task(cfg.task, cfg.data), open_dataset(cfg.data.path or "")
    task.setup(ds)
    checks.check_model(cfg, task, ds)


@pytest.mark.parametrize("task", ["classify", "causal_lm", "regress"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_output_with_logits_is_accepted_in_every_task(data: dict[str, str], task: str, kind: str) -> None:
    check(config(task, data[task], wrapped(task, kind)))


@pytest.mark.parametrize(("task", "needs"), [("causal_lm", "logits [B, L, V]"),
                                             ("classify", "logits [B, num_classes]"),
                                             ("regress", "predictions [B, num_outputs]")])
def test_a_tuple_is_refused_naming_its_type_and_what_the_task_needs(data: dict[str, str], task: str,
                                                                    needs: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check(config(task, data[task], wrapped(task, "tuple")))
    assert str(refused.value) == (
        f"model returned tuple of 3; task={task} needs {needs} or an output with .logits (return the "
        f"tensor, or an object or dict with a logits tensor)")


def test_only_ddp_is_looked_through_for_the_keywords_forward_names(data: dict[str, str]) -> None:
    """A wrapper holding its model as ``self.module`` was called with ``input_ids=``, which only
    the inner model takes."""
    check(config("causal_lm", data["causal_lm"], {"_target_": "model_helpers.HoldsAModule"}))


def test_a_dict_output_trains_to_the_same_losses_as_the_tensor(rank: runtime.Runtime, data: dict[str, str],
                                                               tmp_path: Path) -> None:
    """The task's loss is computed from the logits either way: the same weights, the same losses."""
    losses = []
    for name, model in (("tensor", {"_target_": "jobs.models.GPT", "d_model": 16, "num_heads": 2,
                                    "num_layers": 1}), ("dict", wrapped("causal_lm", "dict"))):
        cfg = config("causal_lm", data["causal_lm"], model)
        paths = trainer.DataPaths(data["causal_lm"], data["causal_lm"])
        checks.check_before_submit(cfg, paths)
        (tmp_path / name).mkdir()
        done = trainer.Trainer(cfg, paths, tmp_path / name, rank).run()
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses.append(([m["train_loss"] for m in metrics if "train_loss" in m], done["final_eval_loss"]))
    assert losses[0] == losses[1] and len(losses[0][0]) == 4


RECIPES = Path(__file__).resolve().parents[3] / "docs" / "recipes"
LOGITS_WRAPPER = '''
import torch
from hf_causal_lm import gpt2


def wrapped_gpt2(vocab_size, seq_len):
    return Logits(gpt2(vocab_size, seq_len))


class Logits(torch.nn.Module):
    """The three-line wrapper users wrote before: forward returns .logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens).logits
'''


def test_a_raw_hugging_face_causal_lm_trains_as_its_logits_wrapper_does(data: dict[str, str],
                                                                        tmp_path: Path) -> None:
    """It ended before submission with a Hydra traceback: AttributeError:
    'CausalLMOutputWithCrossAttentions' object has no attribute 'float'. Under fsdp, with no
    parallelism.fsdp_units, it was refused as having nothing to shard: GPT-2 names its blocks in
    _no_split_modules, and fsdp now shards per GPT2Block (2 gloo ranks), to ddp's losses."""
    pytest.importorskip("transformers")
    (tmp_path / "hfwrap.py").write_text(LOGITS_WRAPPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(RECIPES),
                                                        os.environ.get("PYTHONPATH", "")])}
    losses = []
    for name, extra in (("raw", ["model._target_=hf_causal_lm.gpt2"]),
                        ("wrapped", ["model._target_=hfwrap.wrapped_gpt2"]),
                        ("fsdp", ["model._target_=hf_causal_lm.gpt2", "parallelism.strategy=fsdp"])):
        proc = run_train("task=causal_lm", "model=custom", *extra, f"data.path={data['causal_lm']}",
                         "task.vocab_size=50", "data.seq_len=8", "data.batch_size=4", "optim.max_steps=6",
                         "deterministic=true", "logger=jsonl", "log_every_steps=1", *CHEAP,
                         run_dir=tmp_path / name, env=env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        done = json.loads((tmp_path / name / "summary.json").read_text())
        assert done["world_size"] == 2 and done["steps"] == 6
        losses.append(done["final_train_loss"])
    assert losses[0] == losses[1]
    # 1e-5 relative: the same arithmetic, reduced in another order (as tests/jobs/test_fsdp.py)
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    logs = "".join(p.read_text() for p in (tmp_path / "fsdp" / "submitit").glob("*_log.out"))
    assert "fsdp: 2 units of GPT2Block (the model's _no_split_modules), then the root" in logs


def test_a_pretrained_directory_fine_tunes_checkpoints_and_resumes(data: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """``AutoModelForCausalLM.from_pretrained(dir)`` (hf_causal_lm.pretrained) refuses the meta
    device the model check and fsdp's other ranks built on: "You are using `from_pretrained` with a
    meta device context manager". Saved with zero token embeddings (tied to the head), its first
    loss is ln(50) exactly, which a fresh model's is not: the saved weights are the ones trained."""
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=8, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    torch.nn.init.zeros_(model.transformer.wte.weight)
    model.save_pretrained(tmp_path / "pretrained")
    env = {"PYTHONPATH": os.pathsep.join([str(RECIPES), os.environ.get("PYTHONPATH", "")])}

    def train(steps: int, *extra: str) -> dict[str, Any]:
        proc = run_train("task=causal_lm", "model=custom", "model._target_=hf_causal_lm.pretrained",
                         f"+model.path={tmp_path / 'pretrained'}", f"data.path={data['causal_lm']}",
                         "task.vocab_size=50", "data.seq_len=8", "data.batch_size=4", "log_every_steps=1",
                         f"optim.max_steps={steps}", "checkpoint.every_steps=2", *CHEAP, *extra,
                         run_dir=tmp_path / "run", env=env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        return json.loads((tmp_path / "run" / "summary.json").read_text())

    first = train(4, "parallelism.strategy=fsdp")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["train_loss"] for m in metrics if m.get("step") == 1] == [pytest.approx(np.log(50), rel=1e-6)]
    assert first["world_size"] == 2 and first["steps"] == 4
    resumed = train(6, "parallelism.strategy=fsdp")
    assert resumed["resumed_from"]["step"] == 4 and resumed["steps"] == 6
    assert len(set(resumed["param_checksum_per_rank"])) == 1



def test_activation_checkpointing_recomputes_each_hugging_face_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory.activation_checkpointing=true`` on a Hugging Face model was refused ("has no
    enable_activation_checkpointing()"). Now transformers' own switch is used, per layer (the
    GPT2Blocks fsdp shards, its hooks outside the recompute): each layer's attention runs again in
    the backward, and the gradients are the same as without."""
    pytest.importorskip("transformers")
    from orchestrator.config import MemoryConfig
    from orchestrator.training import blocks, step

    monkeypatch.syspath_prepend(str(RECIPES))
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = step.build_model({"_target_": "hf_causal_lm.gpt2"}, {"vocab_size": 50, "seq_len": 8},
                                 MemoryConfig(activation_checkpointing=checkpointing))
        calls: list[int] = []
        for layer in model.transformer.h:
            layer.attn.register_forward_hook(lambda *_, seen=calls: seen.append(1))  # type: ignore[misc]
        model.train()
        model(input_ids=tokens).logits.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        layers = [type(m).__name__ for m in blocks.checkpointed_layers(model)]
        runs[checkpointing] = (len(calls), grads, layers)
    assert runs[False][0] == 2 and runs[True][0] == 4  # 2 layers; each recomputed once
    assert runs[False][2] == [] and runs[True][2].count("GPT2Block") == 2
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1], strict=True))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_hugging_face_model_trains_with_activation_checkpointing(
        rank: runtime.Runtime, data: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        strategy: str) -> None:
    """The same losses with and without it, under ddp and fsdp, from the checks before submission
    (which ran the model once, checkpointed) to the last step."""
    pytest.importorskip("transformers")
    from orchestrator.config import MemoryConfig, ParallelismConfig

    monkeypatch.syspath_prepend(str(RECIPES))
    losses = []
    for checkpointing in (False, True):
        cfg = dataclasses.replace(config("causal_lm", data["causal_lm"], {"_target_": "hf_causal_lm.gpt2"}),
                                  parallelism=ParallelismConfig(strategy=strategy),
                                  memory=MemoryConfig(activation_checkpointing=checkpointing,
                                                      estimate_cache=None))
        paths = trainer.DataPaths(data["causal_lm"], None)
        checks.check_before_submit(cfg, paths)
        run = tmp_path / f"checkpointing-{checkpointing}"
        run.mkdir()
        done = trainer.Trainer(cfg, paths, run, rank).run()
        assert done["steps"] == 4
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses.append([m["train_loss"] for m in metrics if "train_loss" in m])
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-6)

BUILD_CHECKSUM_LOGGING_QWEN2 = '''
import os
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from orchestrator.training.strategy import checksum


def qwen2(vocab_size, seq_len):
    """A tiny Qwen2: its rotary embedding's inv_freq is a non-persistent buffer. Each rank notes
    the checksum of every weight it builds on the host, the last one being the one it trains."""
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=seq_len))
    if torch.distributed.is_initialized() and not torch.empty(0).is_meta:
        log = Path(os.environ["SWITCHYARD_TEST_BUILD_LOG"]) / f"rank{torch.distributed.get_rank()}"
        with log.open("a") as f:
            f.write(checksum(model.named_parameters()) + "\\n")
    return model
'''


def test_ddp_and_fsdp_start_from_the_same_weights_for_a_model_with_non_persistent_buffers(
        data: dict[str, str], tmp_path: Path) -> None:
    """Such a model is built whole on every fsdp rank (rank 0 cannot send what its state dict lacks).
    That build came after rank 0's host build, from the random state it left, so a tiny Qwen2 started
    from other weights than under ddp on the same seed (and another step-1 loss); GPT-2 has no such
    buffer and was the same."""
    pytest.importorskip("transformers")
    (tmp_path / "qwen_builds.py").write_text(BUILD_CHECKSUM_LOGGING_QWEN2)
    first: dict[str, tuple[list[str], float]] = {}
    for strategy in ("ddp", "fsdp"):
        builds = tmp_path / f"builds-{strategy}"
        builds.mkdir()
        env = {**os.environ, "SWITCHYARD_TEST_BUILD_LOG": str(builds),
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        proc = run_train("task=causal_lm", "model=custom", "model._target_=qwen_builds.qwen2",
                         f"parallelism.strategy={strategy}", f"data.path={data['causal_lm']}",
                         "task.vocab_size=50", "data.seq_len=8", "data.batch_size=4", "optim.max_steps=1",
                         "seed=7", "logger=jsonl", "log_every_steps=1", *CHEAP,
                         run_dir=tmp_path / strategy, env=env)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        trained = [(builds / f"rank{r}").read_text().split()[-1] for r in range(2)]
        step_1 = [json.loads(line)["train_loss"] for line in
                  (tmp_path / strategy / "metrics.jsonl").read_text().splitlines() if '"train_loss"' in line]
        first[strategy] = (trained, step_1[0])
    (ddp, ddp_loss), (fsdp, fsdp_loss) = first["ddp"], first["fsdp"]
    assert len(set(ddp)) == 1 and fsdp == ddp, first
    assert fsdp_loss == pytest.approx(ddp_loss, rel=1e-5)
