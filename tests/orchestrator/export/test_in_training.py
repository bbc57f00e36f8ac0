"""``checkpoint.export`` (orchestrator/training/exporting.py): a raw Hugging Face Llama-style model
trained on 2 ranks under ddp and under fsdp, exported mid-run by a subprocess beside the
training, loads with ``from_pretrained`` (and its tokenizer with ``AutoTokenizer``) and gives the
logits of the checkpoint it came from, read back by a path of its own (``torch.load``, or DCP's
own ``dcp_to_torch_save`` for the fsdp shards). Which steps are due, and an export pruned with
its checkpoint unless ``checkpoint.keep_exports`` keeps it, without a subprocess."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import bpe_dataset
from rank_helpers import write_rows_dataset
from train_helpers import CHEAP, refusal, run_train

from orchestrator.config import CheckpointConfig
from orchestrator.training import checkpoint, exporting, sharded_checkpoint

transformers = pytest.importorskip("transformers")
RECIPES = Path(__file__).resolve().parents[3] / "docs" / "recipes"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_dataset(tmp_path_factory.mktemp("data"))


def train(run: Path, data: Path, *overrides: str) -> dict[str, Any]:
    env = {"PYTHONPATH": os.pathsep.join([str(RECIPES), os.environ.get("PYTHONPATH", "")])}
    proc = run_train("task=causal_lm", f"data.path={data}", "data.seq_len=16", "data.batch_size=4",
                     "optim.max_steps=4", "checkpoint.every_steps=2", *CHEAP, *overrides, run_dir=run,
                     env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads((run / "summary.json").read_text())


def checkpoint_weights(path: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    if sharded_checkpoint.is_sharded(path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, tmp_path / "whole.pt")  # DCP's own consolidation
        path = tmp_path / "whole.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["model"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_llama_exported_mid_run_loads_with_from_pretrained_and_gives_the_checkpoints_logits(
        data: Path, tmp_path: Path, strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    done = train(run, data, "model=custom", "model._target_=hf_causal_lm.llama", "checkpoint.export=hf",
                 "checkpoint.keep_exports=5", f"parallelism.strategy={strategy}")
    assert done["exports"]["exported_steps"] == [2, 4] and done["exports"]["failed"] == []
    out = run / "exports" / "step-000000002-hf"  # mid-run: step 2 of 4
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM"

    monkeypatch.syspath_prepend(str(RECIPES))
    from hf_causal_lm import llama

    reference = llama(vocab_size=300, seq_len=16).eval()
    suffix = ".dcp" if strategy == "fsdp" else ".pt"
    ckpt = run / "checkpoints" / f"step-000000002{suffix}"
    reference.load_state_dict(checkpoint_weights(ckpt, tmp_path))
    ids = tokenizer("import string\nprint(string.ascii_letters)", return_tensors="pt").input_ids[:, :16]
    with torch.no_grad():
        assert (reference(input_ids=ids).logits - loaded(input_ids=ids).logits).abs().max() <= 1e-5
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 2 and record["checkpoint"] == str(ckpt) and record["verification"]["passed"]
    assert record["max_abs_diff"] <= 1e-5 and record["source_run"] == str(run)
    digest = (checkpoint.checksum_path(ckpt).read_text().strip() if strategy == "ddp" else None)
    assert digest is None or record["checkpoint_checksum"] == digest
    assert not [p for p in (run / "exports").iterdir() if p.name.startswith(".")]  # no links, no partials


def exporter_with(tmp_path: Path, **cfg: Any) -> exporting.Exporter:
    """An exporter over published exports of steps 2, 4, 6 and checkpoints of steps 4 and 6."""
    run = tmp_path / "run"
    for step in (2, 4, 6):
        (run / "exports" / f"step-{step:09d}-hf").mkdir(parents=True, exist_ok=True)
    (run / "exports" / ".source-step-000000002").mkdir()  # a killed run's links: the start removes them
    for step in (4, 6):
        checkpoint.path_for(run / "checkpoints", step).parent.mkdir(exist_ok=True)
        checkpoint.path_for(run / "checkpoints", step).write_bytes(b"")
    found = exporting.Exporter(CheckpointConfig(export="hf", every_steps=2, export_every=2, **cfg), run,
                               run / "checkpoints", max_steps=9)
    assert not (run / "exports" / ".source-step-000000002").exists()
    (run / "exports" / ".step-000000008-hf.partial-1-x").mkdir()  # an export being written: kept
    return found


@pytest.mark.parametrize(("keep", "left"), [(None, [4, 6]), (1, [6]), (5, [2, 4, 6])])
def test_an_export_is_pruned_with_its_checkpoint_unless_keep_exports_keeps_it(
        tmp_path: Path, keep: int | None, left: list[int]) -> None:
    exporter = exporter_with(tmp_path, keep_exports=keep)
    try:
        exporter.prune()
        names = sorted(p.name for p in (tmp_path / "run" / "exports").iterdir())
        assert names == [".step-000000008-hf.partial-1-x", *(f"step-{s:09d}-hf" for s in left)]
    finally:
        exporter.finish()


def test_every_export_every_th_checkpoint_and_the_last_is_due(tmp_path: Path) -> None:
    exporter = exporter_with(tmp_path)
    try:
        assert [s for s in range(10) if exporter.due(s)] == [0, 4, 8, 9]  # every 2 x 2 steps, and 9
    finally:
        exporter.finish()


@pytest.mark.parametrize(("override", "expected"), [
    ("checkpoint.export=onnx", "checkpoint.export='onnx' is invalid: must be null or one of ['hf', "
                               "'safetensors'] (try checkpoint.export=hf)"),
    ("checkpoint.export_every=0", "checkpoint.export_every=0 is invalid: must be >= 1 (try "
                                  "checkpoint.export_every=1)"),
    ("checkpoint.keep_exports=0", "checkpoint.keep_exports=0 is invalid: must be null (pruned with its "
                                  "checkpoint) or >= 1 (try checkpoint.keep_exports=2)"),
])
def test_bad_export_keys_are_refused_naming_the_key_and_the_fix(override: str, expected: str) -> None:
    assert refusal(override) == f"error: {expected}"


def test_export_hf_of_a_model_transformers_cannot_represent_is_refused_before_submission(
        tmp_path: Path) -> None:
    rows = write_rows_dataset(tmp_path / "rows", 8, features=3, classes=2, max_rows=4)
    assert refusal("model=mlp", f"data.path={rows}", "data.num_classes=2", "checkpoint.export=hf") == (
        "error: checkpoint.export=hf is invalid for model jobs.models.RowPoolingMLP: transformers can "
        "represent a PreTrainedModel, and model=gpt as GPT2LMHeadModel, not this model (try "
        "checkpoint.export=safetensors)")
    with pytest.raises(AssertionError, match="nothing refused it"):  # safetensors takes any model
        refusal("model=mlp", f"data.path={rows}", "data.num_classes=2", "checkpoint.export=safetensors")
