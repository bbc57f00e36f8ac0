"""The evaluation set is compared with the training set before submission (issue 36): an eval set
tokenized by its own BPE, or an image folder missing one class, trained and reported wrong figures
(eval loss 8.38 for 5.74, accuracy 0.667 for 1.0) with exit 0. ``jobs.prepare tokenizer=DATASET``
tokenizes an eval set as its training set was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rank_helpers import write_rows_dataset

from jobs.prepare import prepare
from orchestrator.config import (
    CausalLmTaskConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GptConfig,
    LoggerConfig,
    MlpConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import checks, runtime, trainer
from sharding import open_dataset

TRAIN_TEXT = "the quick brown fox jumps over the lazy dog; a training corpus of its own words\n"
EVAL_TEXT = "held out: pack my box with five dozen liquor jugs, sphinx of black quartz\n"


def corpus(path: Path, line: str) -> Path:
    path.mkdir()
    for i in range(6):
        (path / f"{i}.txt").write_text(f"{i} {line}" * 8)
    return path


def text(tmp_path: Path, name: str, line: str, tokenizer: str, vocab: int | None = None) -> str:
    output = tmp_path / name
    prepare_text(corpus(tmp_path / f"{name}-corpus", line), output, tokenizer, vocab)
    return str(output)


def prepare_text(source: Path, output: Path, tokenizer: str, vocab: int | None = None) -> None:
    from orchestrator.config import PrepareConfig

    prepare(PrepareConfig(input=str(source), output=str(output), format="text", tokenizer=tokenizer,
                          tokenizer_vocab=vocab))


def lm_config(path: str, eval_path: str) -> TrainConfig:
    return TrainConfig(model=GptConfig(d_model=16, num_heads=2, num_layers=1),
                       task=CausalLmTaskConfig(),
                       data=DataConfig(path=path, eval_path=eval_path, seq_len=8, batch_size=2),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def test_an_eval_set_with_its_own_bpe_is_refused_and_tokenizer_dataset_fixes_it(tmp_path: Path) -> None:
    train = text(tmp_path, "train", TRAIN_TEXT, "bpe", 300)
    own = text(tmp_path, "own", EVAL_TEXT, "bpe", 300)
    with pytest.raises(ConfigError) as refused:
        checks.check_before_submit(lm_config(train, own), trainer.DataPaths(train, own))
    message = str(refused.value)
    assert message.startswith(f"data.eval_path={own!r} does not match data.path={train!r}: its "
                              f"tokenizer is kind 'bpe', vocab_size ")
    hashes = [open_dataset(p).manifest.files[0].xxh3_64 for p in (own, train)]
    assert f"tokenizer.json xxh3 {hashes[0]}, the training set's is kind 'bpe'" in message
    assert f"tokenizer.json xxh3 {hashes[1]}, so its figures would be wrong" in message
    assert message.endswith(f"tokenizer={train} overwrite=true)")

    same = tmp_path / "same"
    prepare_text(tmp_path / "own-corpus", same, train)  # the fix the refusal names
    assert open_dataset(same).attributes["tokenizer"] == open_dataset(train).attributes["tokenizer"]
    assert (same / "tokenizer.json").read_bytes() == (Path(train) / "tokenizer.json").read_bytes()
    checks.check_before_submit(lm_config(train, str(same)), trainer.DataPaths(train, str(same)))


def test_a_bytes_eval_set_beside_a_bpe_training_set_is_refused(tmp_path: Path) -> None:
    train = text(tmp_path, "train", TRAIN_TEXT, "bpe", 300)
    held_out = text(tmp_path, "eval", EVAL_TEXT, "bytes")
    with pytest.raises(ConfigError, match=r"its tokenizer is kind 'bytes', vocab_size 257, eos_id 256, "
                                          r"the training set's is kind 'bpe'"):
        checks.check_before_submit(lm_config(train, held_out), trainer.DataPaths(train, held_out))
    same = tmp_path / "same"
    prepare_text(tmp_path / "eval-corpus", same, text(tmp_path, "bytes", TRAIN_TEXT, "bytes"))
    assert open_dataset(same).attributes["tokenizer"]["kind"] == "bytes"


def test_a_dataset_without_a_tokenizer_is_no_tokenizer(tmp_path: Path) -> None:
    rows = write_rows_dataset(tmp_path / "rows", 8, features=2, classes=2, max_rows=2)
    with pytest.raises(ConfigError, match=r"^tokenizer=.*rows' is invalid: is a dataset that records "
                                          r"no tokenizer"):
        prepare_text(corpus(tmp_path / "c", EVAL_TEXT), tmp_path / "out", rows)


def image_folder(path: Path, classes: list[str]) -> str:
    """``.npy`` images, 2 per class folder; label = the class's place in ``classes``."""
    for name in classes:
        (path / name).mkdir(parents=True)
        for i in range(2):
            np.save(path / name / f"{i}.npy", np.full((3, 8, 8), i, dtype=np.uint8))
    output = path.with_name(path.name + "-ds")
    from orchestrator.config import PrepareConfig

    prepare(PrepareConfig(input=str(path), output=str(output)))
    return str(output)


def image_config(path: str, eval_path: str) -> TrainConfig:
    return TrainConfig(model={"_target_": "model_helpers.TinyResNet"},
                       data=DataConfig(path=path, eval_path=eval_path, batch_size=2),
                       logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def test_an_image_eval_set_missing_a_class_is_refused_naming_both_lists(tmp_path: Path) -> None:
    train = image_folder(tmp_path / "train", ["cat", "dog", "eel"])
    held_out = image_folder(tmp_path / "eval", ["cat", "eel"])
    with pytest.raises(ConfigError) as refused:
        checks.check_before_submit(image_config(train, held_out), trainer.DataPaths(train, held_out))
    assert str(refused.value).startswith(
        f"data.eval_path={held_out!r} does not match data.path={train!r}: its classes is "
        f"['cat', 'eel'], the training set's is ['cat', 'dog', 'eel'], so its figures would be wrong")
    same = image_folder(tmp_path / "same", ["cat", "dog", "eel"])
    checks.check_before_submit(image_config(train, same), trainer.DataPaths(train, same))


def test_a_resume_that_changes_the_eval_set_to_another_shape_is_refused(
        rank: runtime.Runtime, tmp_path: Path) -> None:
    data = write_rows_dataset(tmp_path / "train", 32, features=5, classes=3, max_rows=4)
    good = write_rows_dataset(tmp_path / "good", 16, features=5, classes=3, max_rows=4)
    wide = write_rows_dataset(tmp_path / "wide", 16, features=6, classes=3, max_rows=4)

    def config(eval_path: str, max_steps: int) -> TrainConfig:
        return TrainConfig(model=MlpConfig(), data=DataConfig(path=data, eval_path=eval_path,
                                                              num_classes=3, batch_size=4),
                           optim=OptimConfig(max_steps=max_steps), checkpoint=CheckpointConfig(),
                           logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))

    run = tmp_path / "run"
    run.mkdir()
    trainer.Trainer(config(good, 2), trainer.DataPaths(data, good), run, rank).run()
    with pytest.raises(ConfigError, match=r"its fields is x: float32\[None, 6\], y: int64\[\], the "
                                          r"training set's is x: float32\[None, 5\], y: int64\[\]"):
        checks.check_before_submit(config(wide, 4), trainer.DataPaths(data, wide), run)
