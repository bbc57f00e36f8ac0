"""jobs.prepare format=hf: a Hugging Face dataset (save_to_disk, parquet, multi-column jsonl) through
the ``datasets`` library into shards; a bad column or split is one refusal before any output."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.prepare import prepare
from orchestrator.config import ConfigError, PrepareConfig
from sharding import open_dataset

pytestmark = pytest.mark.skipif(find_spec("datasets") is None, reason="needs datasets")

# feats: one row of 3 features ([rows, features], what task=classify's row models read)
ROWS = [{"text": f"row {i} says hello", "feats": [[float(i), i / 2.0, -1.0]], "label": i % 3}
        for i in range(10)]


def _config(input_path: Path, output: Path, **kwargs: Any) -> PrepareConfig:
    return PrepareConfig(input=str(input_path), output=str(output), **kwargs)


@pytest.fixture(scope="module")
def datasets() -> Any:
    """The library, imported by the worker that runs these tests, not by every worker's collection
    (pandas and pyarrow come with it)."""
    import datasets

    return datasets


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, datasets: Any) -> Path:
    """A DatasetDict with train/test splits, label a ClassLabel, as save_to_disk writes it."""
    features = datasets.Features({"text": datasets.Value("string"),
                                  "feats": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
                                  "label": datasets.ClassLabel(names=["cat", "dog", "eel"])})
    table = datasets.Dataset.from_list(ROWS, features=features)
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.DatasetDict({"train": table.select(range(8)), "test": table.select(range(8, 10))}
                         ).save_to_disk(str(path))
    return path


def test_a_saved_split_becomes_fields_and_labels_with_its_class_names(saved: Path, tmp_path: Path) -> None:
    result = prepare(_config(saved, tmp_path / "out", fields=["feats"], label_field="label", split="train"))
    ds = open_dataset(tmp_path / "out")
    assert result.num_samples == len(ds) == 8
    assert ds.manifest.attributes["classes"] == ["cat", "dog", "eel"]
    feats, label = np.asarray(ds[5]["feats"]), np.asarray(ds[5]["y"])
    assert feats.dtype == np.float32 and feats.tolist() == [[5.0, 2.5, -1.0]]
    assert label.dtype == np.int64 and int(label) == 2
    test = prepare(_config(saved, tmp_path / "test", fields=["feats"], label_field="label", split="test"))
    assert test.num_samples == 2


def test_an_image_column_becomes_uint8_channels_a_palette_its_colours(tmp_path: Path, datasets: Any) -> None:
    """As the image folder reads images: a palette image (PNG/GIF "P" mode) is its colours, RGB,
    not its palette indices in one channel."""
    from PIL import Image

    palette = Image.new("P", (4, 2))
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.putpixel((1, 0), 1)
    rgb = Image.new("RGB", (4, 2), (7, 8, 9))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_list([{"image": palette, "label": 0}, {"image": rgb, "label": 1}],
                               features=features).save_to_disk(str(tmp_path / "images"))
    prepare(_config(tmp_path / "images", tmp_path / "out", fields=["image"], label_field="label"))
    ds = open_dataset(tmp_path / "out")
    first, second = np.asarray(ds[0]["image"]), np.asarray(ds[1]["image"])
    assert first.dtype == np.uint8 and first.shape == (3, 2, 4)
    assert first[:, 0, 1].tolist() == [200, 100, 50] and first[:, 0, 0].tolist() == [0, 0, 0]
    assert second[:, 1, 3].tolist() == [7, 8, 9]


def test_a_parquet_text_column_is_tokenized_as_text_is(tmp_path: Path, datasets: Any) -> None:
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    prepare(_config(tmp_path / "rows.parquet", tmp_path / "out", text_field="text"))  # format=auto
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 10 and ds.manifest.attributes["tokenizer"]["kind"] == "bytes"
    tokens = np.asarray(ds[3]["tokens"])
    assert bytes(tokens[:-1].astype(np.uint8)) == b"row 3 says hello" and tokens[-1] == 256  # EOS


def test_a_multi_column_jsonl_is_read_by_columns_with_format_hf(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    prepare(_config(tmp_path / "rows.jsonl", tmp_path / "out", format="hf", fields=["feats"],
                    label_field="label"))
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 10 and np.asarray(ds[9]["feats"]).tolist() == [[9.0, 4.5, -1.0]]
    assert int(ds[9]["y"]) == 0
    assert "classes" not in ds.manifest.attributes  # plain integers name no classes


@pytest.mark.parametrize(("options", "message"), [
    ({"fields": ["feats"], "split": "validation"},
     "split='validation' is invalid: input={input!r} has splits ['train', 'test'] (try split=train or "
     "split=test)"),
    # it said "split=None is invalid" and proposed one split: the key was not set at all
    ({"fields": ["feats"]},
     "split is needed: input={input!r} is a DatasetDict of 2 splits, train, test: name the one to prepare "
     "(try split=train or split=test)"),
    ({"fields": ["pixels"], "split": "train"},
     "fields=['pixels'] is invalid: input={input!r} has no column 'pixels' (its columns: ['text', "
     "'feats', 'label']) (try fields=<one of them>)"),
    ({"text_field": "txt", "split": "train"},
     "text_field='txt' is invalid: input={input!r} has no column 'txt' (its columns: ['text', "
     "'feats', 'label']) (try text_field=<one of them>)"),
    ({"fields": ["text"], "split": "train"},
     "fields: column 'text' of row 0 holds <U16 values, not numbers (try text_field=text for text)"),
    ({"split": "train"}, "format='hf' is invalid: needs the columns to read: input={input!r} has ['text', "
                         "'feats', 'label'] (try text_field=text or fields=[text])"),
])
def test_a_bad_column_or_split_is_refused_before_any_output(saved: Path, tmp_path: Path,
                                                            options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        prepare(_config(saved, tmp_path / "out", **options))
    assert str(refused.value) == message.format(input=str(saved))
    assert list(tmp_path.iterdir()) == []


def test_an_hf_key_on_another_input_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "doc.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"^text_field='text' is invalid: is only read for Hugging Face "
                                          r"datasets \(format=hf\)"):
        prepare(_config(tmp_path / "doc.txt", tmp_path / "out", text_field="text"))


def test_the_command_prints_one_error_line_for_a_wrong_split(saved: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={saved}",
                           f"output={tmp_path / 'out'}", "format=hf", "fields=[feats]", "split=dev"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"jobs.prepare: error: split='dev' is invalid: input={str(saved)!r} has splits ['train', 'test'] "
        f"(try split=train or split=test)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task", ["causal_lm", "classify"])
def test_what_format_hf_prepares_trains(saved: Path, tmp_path: Path, task: str, datasets: Any) -> None:
    """Parquet text to causal_lm (its vocabulary from the recorded tokenizer); a saved split's
    fields and ClassLabel to classify (its classes from the dataset): both train, in one rank."""
    from rank_helpers import one_rank

    from orchestrator.config import (
        CausalLmTaskConfig,
        ClassifyTaskConfig,
        DataConfig,
        LoggerConfig,
        OptimConfig,
        TelemetryConfig,
        TrainConfig,
    )
    from orchestrator.training import checks, trainer

    data = tmp_path / "data"
    if task == "causal_lm":
        datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
        prepare(_config(tmp_path / "rows.parquet", data, text_field="text"))
        model: dict[str, Any] = {"_target_": "jobs.models.GPT", "d_model": 16, "num_heads": 2,
                                 "num_layers": 1}
        task_config: Any = CausalLmTaskConfig()
    else:
        prepare(_config(saved, data, fields=["feats"], label_field="label", split="train"))
        model, task_config = {"_target_": "jobs.models.RowPoolingMLP", "hidden_dim": 8}, ClassifyTaskConfig()
    cfg = TrainConfig(model=model, task=task_config, data=DataConfig(path=str(data), seq_len=8, batch_size=2,
                                                                     input_field="feats"),
                      optim=OptimConfig(max_steps=2), logger=LoggerConfig(tensorboard=False),
                      telemetry=TelemetryConfig(enabled=False))
    paths = trainer.DataPaths(str(data), str(data))
    checks.check_before_submit(cfg, paths)
    (tmp_path / "run").mkdir()
    with one_rank(tmp_path) as rank:
        done = trainer.Trainer(cfg, paths, tmp_path / "run", rank).run()
    assert done["steps"] == 2 and np.isfinite(done["final_eval_loss"])
