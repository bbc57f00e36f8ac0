"""``jobs.prepare format=hf``: a Hugging Face dataset's rows -> samples, through the ``datasets``
library (``pip install 'switchyard[hf]'``), never a hand-written Arrow reader.

Inputs: a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (its
splits chosen with ``split=``), a ``.parquet`` file, or a ``.jsonl`` file of several columns. The
rows are streamed: a saved dataset is memory-mapped Arrow, and parquet and jsonl are read with
``streaming=True``, one batch of rows at a time, so memory stays bounded whatever the input's size.

- ``text_field=COLUMN``: each row's text, tokenized as ``format=text`` does (``tokenizer=``).
- ``fields=[A,B]``: each column becomes a field of the same name (numbers and lists as arrays,
  an image as uint8 ``[C, H, W]``); ``label_field=COLUMN`` becomes field ``y`` (int64 for
  integers, float32 for floats). A ``ClassLabel`` column's names are the manifest's ``classes``.

Every problem of the input (a missing column, an unknown split) is found before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jobs.image_folder import image_array
from jobs.text_corpus import Corpus
from orchestrator.config import ConfigError, PrepareConfig, invalid

LABEL_FIELD = "y"
SAVED_FILES = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top


def as_hf(path: Path) -> Path | None:
    """A save_to_disk directory or a .parquet file: what format=auto reads as hf."""
    if path.is_dir() and any((path / name).is_file() for name in SAVED_FILES):
        return path
    return path if path.is_file() and path.suffix.lower() == ".parquet" else None


def as_hf_explicit(path: Path) -> Path | None:
    """With format=hf, a .jsonl file is read by columns too."""
    return as_hf(path) or (path if path.is_file() and path.suffix.lower() == ".jsonl" else None)


@dataclass
class Table:
    """One split of the input, ready to stream."""

    rows: Any  # a datasets.Dataset (memory-mapped) or IterableDataset (streamed)
    num_rows: int
    columns: list[str]
    features: Any  # datasets.Features, or None where streaming json does not know them yet


def open_table(path: Path, split: str | None) -> Table:
    datasets = _import_datasets()
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            raise invalid("input", str(path), f"is not a dataset datasets can load ({e})",
                          "a directory written by save_to_disk") from e
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            choices = " or ".join(f"split={name}" for name in splits)  # every split it has
            if split is None and len(splits) != 1:
                raise ConfigError(f"split is needed: input={str(path)!r} is a DatasetDict of "
                                  f"{len(splits)} splits, {', '.join(splits)}: name the one to "
                                  f"prepare (try {choices})")
            if split is not None and split not in loaded:
                raise invalid("split", split, f"input={str(path)!r} has splits {splits}", choices)
            loaded = loaded[split or splits[0]]
        elif split is not None:
            raise invalid("split", split, f"input={str(path)!r} is one dataset without splits",
                          "drop split")
        return Table(loaded, len(loaded), list(loaded.column_names), loaded.features)
    if split is not None:
        raise invalid("split", split, f"input={str(path)!r} is one file without splits", "drop split")
    builder = "parquet" if path.suffix.lower() == ".parquet" else "json"
    rows = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    if builder == "parquet":
        import pyarrow.parquet as pq

        num_rows = pq.ParquetFile(path).metadata.num_rows
    else:
        with path.open("rb") as f:
            num_rows = sum(1 for line in f if line.strip())
    first = next(iter(rows), None)
    if first is None:
        raise invalid("input", str(path), "holds no rows", "a file with at least one row")
    return Table(rows, num_rows, list(first), rows.features)


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("format=hf reads through the datasets library, which is not installed "
                          "(try pip install 'switchyard[hf]')") from e
    datasets.disable_progress_bars()  # jobs.prepare shows its own
    return datasets


def check_columns(table: Table, cfg: PrepareConfig) -> None:
    """What to read is named, and every named column exists."""
    if cfg.text_field is None and not cfg.fields:
        raise invalid("format", "hf", f"needs the columns to read: input={cfg.input!r} has "
                                      f"{table.columns}", f"text_field={table.columns[0]} or "
                                                          f"fields=[{table.columns[0]}]")
    if cfg.text_field is not None and (cfg.fields or cfg.label_field is not None):
        raise invalid("text_field", cfg.text_field, "makes token samples; fields and label_field "
                                                    "make tabular ones", "one of them")
    for key, names in (("text_field", [cfg.text_field]), ("fields", list(cfg.fields)),
                       ("label_field", [cfg.label_field])):
        missing = [n for n in names if n is not None and n not in table.columns]
        if missing:
            value = cfg.fields if key == "fields" else missing[0]
            raise invalid(key, value, f"input={cfg.input!r} has no column {missing[0]!r} (its "
                                      f"columns: {table.columns})", f"{key}=<one of them>")
    if cfg.label_field is not None and LABEL_FIELD in cfg.fields:
        raise invalid("fields", cfg.fields, f"holds {LABEL_FIELD!r}, the labels' field", "rename it")


def classes(table: Table, label_field: str | None) -> list[str] | None:
    """A ClassLabel column's names, in label order (what train and eval sets are compared on)."""
    feature = None if table.features is None or label_field is None else table.features.get(label_field)
    names = getattr(feature, "names", None)
    return list(names) if names else None


def row_samples(table: Table, fields: list[str],
                label_field: str | None) -> Iterator[dict[str, np.ndarray]]:
    for index, row in enumerate(_rows(table)):
        yield _sample(row, index, fields, label_field)


def check_first_row(table: Table, cfg: PrepareConfig) -> None:
    """The first row converts (a text column under fields= is refused here, before any output)."""
    row = next(_rows(table))
    if cfg.text_field is not None:
        if not isinstance(row[cfg.text_field], str):
            raise invalid("text_field", cfg.text_field, f"row 0 holds "
                                                        f"{type(row[cfg.text_field]).__name__}, not text",
                          "the name of a text column")
        return
    _sample(row, 0, list(cfg.fields), cfg.label_field)


def _sample(row: dict[str, Any], index: int, fields: list[str],
            label_field: str | None) -> dict[str, np.ndarray]:
    sample = {name: _array(row[name], name, index) for name in fields}
    if label_field is not None:
        sample[LABEL_FIELD] = _label(row[label_field], label_field, index)
    return sample


def _rows(table: Table) -> Iterator[dict[str, Any]]:
    rows = table.rows
    if hasattr(rows, "to_iterable_dataset"):  # a memory-mapped Dataset: stream it by batches
        rows = rows.to_iterable_dataset()
    yield from rows


def _array(value: Any, name: str, index: int) -> np.ndarray:
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image -> uint8 [C, H, W]
        return image_array(value, f"column {name!r} of row {index}")
    try:
        array = np.asarray(value)
    except ValueError as e:  # ragged lists
        raise ConfigError(f"fields: column {name!r} of row {index} is not an array ({e})") from e
    if array.dtype.kind not in "biuf":
        raise ConfigError(f"fields: column {name!r} of row {index} holds {array.dtype} values, not "
                          f"numbers (try text_field={name} for text)")
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _label(value: Any, name: str, index: int) -> np.ndarray:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ConfigError(f"label_field={name!r}: row {index} holds {value!r}, not a number")
    return np.asarray(value, np.int64 if isinstance(value, int | np.integer) else np.float32)


class RowCorpus(Corpus):
    """The text column of a table as the documents ``format=text`` tokenizes (and trains a BPE on)."""

    def __init__(self, table: Table, text_field: str) -> None:
        super().__init__([], skip_bad=False)
        self.table, self.text_field = table, text_field

    def located_documents(self) -> Iterator[tuple[str, str]]:
        for index, row in enumerate(_rows(self.table)):
            text = row[self.text_field]
            if not isinstance(text, str):
                raise ConfigError(f"text_field={self.text_field!r}: row {index} holds "
                                  f"{type(text).__name__}, not text")
            yield f"row {index}", text

