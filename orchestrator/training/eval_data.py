"""The evaluation set must mean what the training set means, checked before submission.

An eval set tokenized by another tokenizer (its own ``tokenizer=bpe``: 13,126 ids where the
training set had 16,384), or an image folder missing one class (every later label shifted by one),
trained and evaluated without a word and reported wrong figures as a success. So every recorded
property the task's figures depend on is compared: the tokenizer (kind, vocabulary size, EOS id
and the ``tokenizer.json`` hash), the class names in label order, and each field's name, dtype and
shape (the leading size, where it varies per sample, aside). What legitimately differs (the sample,
token and document counts, the largest token id, the label range) is not compared. A resume that
changes ``data.eval_path`` goes through the same check: it runs before every submission.
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import ConfigError
from sharding import ShardedDataset

TOKENIZER_KEYS = ("kind", "vocab_size", "eos_id")


def check_eval_matches(train: ShardedDataset, held_out: ShardedDataset) -> None:
    """ConfigError naming the first property in which ``data.eval_path`` differs from ``data.path``,
    both values, and the fix."""
    for what, train_value, eval_value, fix in differences(train, held_out):
        if train_value != eval_value:
            raise ConfigError(f"data.eval_path={str(held_out.root)!r} does not match data.path="
                              f"{str(train.root)!r}: its {what} is {eval_value}, the training set's "
                              f"is {train_value}, so its figures would be wrong ({fix})")


def differences(train: ShardedDataset, held_out: ShardedDataset) -> list[tuple[str, Any, Any, str]]:
    """(property, training value, eval value, fix) for each property compared, in order."""
    prepare = "prepare it again with the training set's"
    return [
        ("tokenizer", tokenizer(train), tokenizer(held_out),
         f"{prepare} tokenizer: python -m jobs.prepare input=... output={held_out.root} "
         f"tokenizer={train.root} overwrite=true"),
        ("classes", classes(train), classes(held_out),
         f"{prepare} class names: an image folder with a folder, of at least one image, for "
         f"every class of the training set"),
        ("fields", fields(train), fields(held_out), f"{prepare} fields, dtypes and shapes"),
    ]


def fields(ds: ShardedDataset) -> str:
    """``x: uint8[3, 32, 32], y: int64[]``: names, dtypes and shapes (None: a varying leading size)."""
    return ", ".join(f"{name}: {spec.dtype}{list(spec.shape)}" for name, spec in ds.schema.items())


def tokenizer(ds: ShardedDataset) -> str:
    recorded = attributes(ds).get("tokenizer")
    if not isinstance(recorded, dict):
        return "none recorded"
    described = ", ".join(f"{key} {recorded.get(key)!r}" for key in TOKENIZER_KEYS)
    name = recorded.get("file")
    hashes = {f.name: f.xxh3_64 for f in ds.manifest.files}
    return described + (f", {name} xxh3 {hashes.get(name)}" if name else "")


def classes(ds: ShardedDataset) -> str:
    recorded = attributes(ds).get("classes")
    return "none recorded" if recorded is None else repr(recorded)


def attributes(ds: ShardedDataset) -> dict[str, Any]:
    return getattr(ds, "attributes", None) or {}
