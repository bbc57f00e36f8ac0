"""A language model's vocabulary is checked against the dataset's token ids before submission: an
id beyond ``task.vocab_size`` was ``IndexError: index out of range in self`` on every rank after
the queue wait (issue 34). The largest id is the one ``jobs.prepare`` records, or read from the
shards of a dataset that records none."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from jobs import train
from jobs.prepare import prepare
from orchestrator.config import ConfigError, PrepareConfig, TrainConfig
from sharding import DatasetWriter, open_dataset
from sharding.windows import _largest_in

GPT = ["task=causal_lm", "model=gpt", "model.d_model=16", "model.num_heads=2", "model.num_layers=1",
       "data.seq_len=8", "data.batch_size=2", "logger=jsonl", "memory.estimate=off"]


def config(tmp_path: Path, *overrides: str) -> TrainConfig:
    with initialize_config_module("conf", version_base="1.3"):
        composed = compose("train", overrides=[f"data.cache_dir={tmp_path / 'cache'}", *GPT, *overrides])
    return cast(TrainConfig, OmegaConf.to_object(composed))


def tokens(path: Path, largest: int, *, label: bool = False) -> Path:
    """Documents of uint16 ids below ``largest``, one of them holding ``largest``; with ``label``
    a second field beside them. No tokenizer and no largest id recorded: they are read."""
    with DatasetWriter(path) as writer:
        for doc in range(20):
            ids = np.arange(doc, doc + 30, dtype=np.uint16) % largest
            if doc == 13:
                ids[7] = largest
            writer.append({"tokens": ids, **({"y": np.int64(doc)} if label else {})})
    return path


def text(tmp_path: Path) -> Path:
    (tmp_path / "corpus.txt").write_text("hello, world: a byte-level corpus of one document\n" * 4)
    prepare(PrepareConfig(input=str(tmp_path / "corpus.txt"), output=str(tmp_path / "text")))
    return tmp_path / "text"


def test_a_vocabulary_below_the_recorded_largest_id_is_refused_naming_both(tmp_path: Path) -> None:
    data = text(tmp_path)
    assert open_dataset(data).attributes["max_token_id"] == 256  # EOS of the bytes tokenizer
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, f"data.path={data}", "task.vocab_size=200"))
    assert str(refused.value) == (
        f"task.vocab_size=200 is invalid: data.path='{data}' has token ids up to 256 in 'tokens', so "
        f"the model needs a vocabulary of at least 257 (try task.vocab_size=257)")
    train.check_before_submit(config(tmp_path, f"data.path={data}", "task.vocab_size=257"))
    train.check_before_submit(config(tmp_path, f"data.path={data}"))  # the tokenizer's 257


@pytest.mark.parametrize("label", [False, True], ids=["one field", "two fields"])
def test_ids_of_a_dataset_that_records_none_are_read_from_its_shards(tmp_path: Path, label: bool) -> None:
    data = tokens(tmp_path / "ids", 299, label=label)
    with pytest.raises(ConfigError, match=r"^task.vocab_size=100 is invalid: data.path=.* has token ids "
                       r"up to 299 in 'tokens', .* \(try task.vocab_size=300\)$"):
        train.check_before_submit(config(tmp_path, f"data.path={data}", "task.vocab_size=100"))
    train.check_before_submit(config(tmp_path, f"data.path={data}", "task.vocab_size=300"))


def test_the_evaluation_set_is_checked_too(tmp_path: Path) -> None:
    data, held_out = tokens(tmp_path / "train", 50), tokens(tmp_path / "eval", 120)
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, f"data.path={data}", f"data.eval_path={held_out}",
                                         "task.vocab_size=100"))
    assert str(refused.value).startswith(
        f"task.vocab_size=100 is invalid: data.eval_path='{held_out}' has token ids up to 120")
    assert str(refused.value).endswith("(try task.vocab_size=121)")


@pytest.mark.parametrize("block_tokens", [1, 7, 64, 1 << 23])
def test_the_blockwise_read_finds_the_largest_id_of_the_documents_only(block_tokens: int) -> None:
    rng = np.random.default_rng(block_tokens)
    for _ in range(50):
        tokens = rng.integers(0, 1000, size=400)  # the data file: documents and other fields
        lengths = rng.integers(0, 12, size=int(rng.integers(1, 20)))
        starts = np.sort(rng.choice(400 - 12, size=len(lengths), replace=False))
        expected = max((int(tokens[s:s + n].max()) for s, n in zip(starts, lengths, strict=True) if n),
                       default=0)
        assert _largest_in(tokens, starts, lengths, block_tokens) == expected
