"""``switchyard export`` (orchestrator/export/): a real 2-rank run of ``model=gpt`` on BPE tokens
exported as a GPT2LMHeadModel directory (with its tokenizer) and as safetensors, each compared
with the checkpoint by a path of its own (``torch.load`` of the checkpoint into a fresh model);
by registry id; shown by ``switchyard show``; every bad input one line and exit 2; a failed or
killed export leaves nothing that looks complete."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import bpe_dataset
from train_helpers import CHEAP, run_train

from jobs.models import GPT
from orchestrator import cli
from orchestrator.export import verify
from orchestrator.registry.db import Registry
from orchestrator.sweeps import status
from orchestrator.training import checkpoint

transformers = pytest.importorskip("transformers")


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gpt")
    data = bpe_dataset(root)
    proc = ok(run_train("task=causal_lm", "model=gpt", "model.d_model=32", "model.num_heads=4",
                        "model.num_layers=2", f"data.path={data}", "data.seq_len=16", "data.batch_size=4",
                        "optim.max_steps=4", "checkpoint.every_steps=2", *CHEAP, run_dir=root / "run"))
    job = re.search(r"^job: (\d+/\d+)", proc.stdout, re.MULTILINE)
    assert job is not None, proc.stdout
    return {"run": root / "run", "job": job.group(1), "data": data}


def export(*args: Any, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_model(run: Path, step: int) -> tuple[GPT, dict[str, Any]]:
    """The checkpoint's model by a path of its own: torch.load into a fresh GPT."""
    state = torch.load(checkpoint.path_for(run / "checkpoints", step), map_location="cpu", weights_only=False)
    model = GPT(vocab_size=300, seq_len=16, d_model=32, num_heads=4, num_layers=2)
    model.load_state_dict(state["model"])
    return model.eval(), state


def test_model_gpt_exports_as_gpt2_with_its_tokenizer(gpt_run: dict[str, Any], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    code, printed, err = export(gpt_run["run"], "--step", 2, "--format", "hf", out, capsys=capsys)
    assert code == 0, err
    assert "step 2" in printed and "GPT2LMHeadModel" in printed
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    model, _ = checkpoint_model(gpt_run["run"], 2)
    ids = tokenizer("def wrap(text):\n    return text", return_tensors="pt").input_ids[:, :16]
    assert tokenizer.decode(ids[0]) == "def wrap(text):\n    return text"[:len(tokenizer.decode(ids[0]))]
    assert tokenizer.eos_token == "<|endoftext|>" and loaded.config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        assert (model(ids) - loaded(input_ids=ids).logits).abs().max() <= 1e-5
    record = json.loads((out / "export.json").read_text())
    ckpt = checkpoint.path_for(gpt_run["run"] / "checkpoints", 2)
    assert record["step"] == 2 and record["format"] == "hf" and record["checkpoint"] == str(ckpt)
    assert record["checkpoint_checksum"] == checkpoint.checksum_path(ckpt).read_text().strip()
    assert record["source_run"] == str(gpt_run["run"]) and "code_hash" in record
    assert record["verification"]["passed"] and record["max_abs_diff"] <= 1e-5
    assert record["verification"]["parameters"] == record["verification"]["parameters_reloaded"] \
        == sum(p.numel() for p in model.parameters())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(out))


def test_past_the_size_limit_the_safetensors_are_sharded_with_an_index(
        gpt_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sharded"
    code, _, err = export(gpt_run["run"], "--format", "hf", "--max-shard-mb", 0.03, out, capsys=capsys)
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    model, _ = checkpoint_model(gpt_run["run"], 4)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - loaded(input_ids=tokens).logits).abs().max() <= 1e-5


def test_safetensors_holds_the_checkpoints_weights_and_its_config(
        gpt_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_model

    out = tmp_path / "st"
    code, _, err = export(gpt_run["run"], "--format", "safetensors", out, capsys=capsys)
    assert code == 0, err
    config = json.loads((out / "switchyard_config.json").read_text())
    assert config["model"]["_target_"] == "jobs.models.GPT" and config["step"] == 4
    assert config["dataset_kwargs"] == {"vocab_size": 300, "seq_len": 16} and "code_hash" in config
    assert config["run_config"]["data"]["path"] == str(gpt_run["data"])
    spec = {k: v for k, v in config["model"].items() if k != "_target_"}
    rebuilt = GPT(**config["dataset_kwargs"], **spec)
    load_model(rebuilt, str(out / "model.safetensors"))
    model, _ = checkpoint_model(gpt_run["run"], 4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, rebuilt.state_dict()[name]), name
    record = json.loads((out / "export.json").read_text())
    assert record["verification"]["weights_equal"] and record["max_abs_diff"] == 0.0


def test_a_registry_id_exports_and_switchyard_show_lists_it(gpt_run: dict[str, Any], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "by-id"
    code, _, err = export(gpt_run["job"], "--format", "hf", out, capsys=capsys)
    assert code == 0, err
    shown, as_json = io.StringIO(), io.StringIO()
    with Registry() as reg:  # the session's (tests/conftest.py), where jobs.train recorded the run
        assert status.cmd_show(reg, gpt_run["job"], False, out=shown) == 0
        assert status.cmd_show(reg, gpt_run["job"], True, out=as_json) == 0
    assert f"export: step 4 as hf (GPT2LMHeadModel) -> {out}; verified: max |logit diff|" in shown.getvalue()
    assert str(out) in [e["path"] for e in json.loads(as_json.getvalue())["exports"]]


def mlp_run(root: Path) -> Path:
    """A run directory holding one checkpoint of model=mlp (a classifier transformers has no class for)."""
    from jobs.models import RowPoolingMLP

    model = RowPoolingMLP(in_features=3, num_classes=2, hidden_dim=8)
    compat = {"model": {"_target_": "jobs.models.RowPoolingMLP", "hidden_dim": 8, "num_layers": 2},
              "in_features": 3, "num_classes": 2, "task": {}, "optimizer": "adamw", "amp_scaler": False,
              "strategy": "ddp", "seed": 0, "data": "x", "samples_per_step": 4}
    checkpoint.save(root / "checkpoints", 3, {"step": 3, "compat": compat, "model": model.state_dict()}, 2)
    return root


BAD = {
    "no checkpoint": (lambda run, tmp: [tmp / "empty", "--format", "hf", tmp / "o"],
                      r"RUN='.*empty' has no checkpoint in .*empty/checkpoints: train it with "
                      r"checkpoint.every_steps=N"),
    "no such step": (lambda run, tmp: [run, "--step", 3, "--format", "hf", tmp / "o"],
                     r"--step 3: .* has no checkpoint of step 3 \(it has steps 2, 4; try --step 4\)"),
    "OUT not empty": (lambda run, tmp: [run, "--format", "hf", tmp / "full"],
                      r"OUT='.*full' exists and is not empty: name a new directory, or add --overwrite"),
    "OUT is the run": (lambda run, tmp: [run, "--format", "hf", "--overwrite", run],
                       r"OUT='.*run' would hold or replace .*run: name a directory of its own"),
    "OUT in a checkpoint": (lambda run, tmp: [run, "--format", "hf", checkpoint.path_for(
        run / "checkpoints", 4) / "x"], r"OUT='.*step-000000004.pt/x' would hold or replace"),
    "hf of an mlp": (lambda run, tmp: [mlp_run(tmp / "mlp"), "--format", "hf", tmp / "o"],
                     r"--format hf: model jobs.models.RowPoolingMLP is not a transformers model, and "
                     r"transformers cannot represent it .*; use --format safetensors"),
    "no such run": (lambda run, tmp: [tmp / "nowhere", "--format", "hf", tmp / "o"],
                    r"RUN='.*nowhere' is neither a directory nor a job of the registry"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_naming_the_value_and_the_fix(
        gpt_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in gpt_run["run"].rglob("*"))
    make, expected = BAD[case]
    code, printed, err = export(*make(gpt_run["run"], tmp_path), capsys=capsys)
    assert code == 2 and printed == ""
    assert len(err.splitlines()) == 1 and err.startswith("switchyard export: error: "), err
    assert re.search(expected, err), err
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"  # nothing the user had is touched
    assert not (tmp_path / "o").exists()
    assert sorted(p.name for p in gpt_run["run"].rglob("*")) == before


def test_an_mlp_exports_as_safetensors_and_overwrite_replaces_only_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = mlp_run(tmp_path / "mlp")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    code, _, err = export(run, "--format", "safetensors", "--overwrite", out, capsys=capsys)
    assert code == 0, err
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 3 and record["verification"]["batch_shape"] == [2, 4, 3]
    assert record["verification"]["passed"] and record["max_abs_diff"] == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "out"]  # no partial or old left


def test_an_export_that_does_not_verify_publishes_nothing(gpt_run: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = verify.compare

    def off_by_a_bit(original: Any, reloaded: Any, *args: Any) -> dict[str, Any]:
        with torch.no_grad():
            next(reloaded.parameters()).add_(0.5)  # as a mis-mapped weight would
        return real(original, reloaded, *args)

    monkeypatch.setattr(verify, "compare", off_by_a_bit)
    code, _, err = export(gpt_run["run"], "--format", "hf", tmp_path / "out", capsys=capsys)
    assert code == 1 and "did not reload to the checkpoint's model (max |logit difference|" in err
    assert os.listdir(tmp_path) == []


def test_an_export_killed_mid_write_leaves_nothing_that_looks_complete(gpt_run: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """Killed (SIGKILL) once its model file is on disk, before the reload and the rename: OUT does
    not exist, only a hidden partial directory without export.json, which the next export to
    the same OUT removes."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "orchestrator.export", str(gpt_run["run"]), str(out), "--format", "hf"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            written = [p for p in tmp_path.glob(".out.partial-*/model.safetensors")]
            if written:
                break
            time.sleep(0.005)
        assert proc.poll() is None and written, "the export ended before it could be killed mid-write"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".out.partial-")
    assert not (left[0] / "export.json").exists()
    ok(subprocess.run(command, capture_output=True, text=True, timeout=300))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / "export.json").read_text())["verification"]["passed"]
