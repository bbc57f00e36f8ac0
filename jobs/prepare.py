"""``python -m jobs.prepare input=... output=...``: raw samples -> a sharded dataset.

Inputs (``format=auto`` tells them apart by path):

- ``npy_dir``: a directory of ``.npy`` files, one sample each, in sorted (byte-wise) name order;
  read by ``num_workers`` processes, in order, while this process writes.
- ``pt``: a ``.pt`` file holding a list of tensors or a list of dicts of tensors; loaded with
  ``weights_only=True`` (no arbitrary pickles) and memory-mapped, so it need not fit in RAM.
- ``megatron``: a Megatron-LM indexed dataset ``PREFIX.bin`` + ``PREFIX.idx``; every sequence
  becomes one 1-D sample (document boundaries are not kept).
- ``text``: a ``.txt`` file, a ``.jsonl`` file or a directory of documents, tokenized into one
  ``tokens`` sample per document with EOS appended (``jobs/text_corpus.py``); the manifest's
  attributes name the tokenizer, whose ``tokenizer.json`` (if any) the dataset ships.
- ``image_folder``: ``DIR/<class>/*.png|jpg|jpeg|npy`` -> ``x`` uint8 ``[C, H, W]`` and ``y`` int64,
  the class names in the manifest's attributes (``jobs/image_folder.py``).
- ``hf``: a Hugging Face dataset (``save_to_disk`` directory, ``.parquet``, ``.jsonl`` by columns)
  through the ``datasets`` library: ``text_field=`` tokenized as text, or ``fields=`` and
  ``label_field=`` as arrays, one ``split=`` (``jobs/hf_dataset.py``).

``labels=FILE.npy`` adds field ``y`` to a ``npy_dir`` input, one label per file.

A bare array becomes field ``field`` (default ``x``). Every input problem is reported before
anything is created at ``output``; a problem found mid-way publishes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from tqdm import tqdm

from jobs import hf_dataset
from jobs.image_folder import (
    check_same_shape,
    list_images,
    load_image,
    looks_like_image_folder,
    skipped_note,
)
from jobs.text_corpus import (
    TOKENIZER_FILE,
    Corpus,
    TextTokenizer,
    TokenCount,
    bytes_tokenizer,
    corpus_files,
    count_documents,
    dataset_tokenizer,
    load_tokenizer,
    token_samples,
    train_bpe,
)
from orchestrator.config import ConfigError, PrepareConfig, invalid, omegaconf_error, register_configs
from orchestrator.entry import hydra_app, hydra_task
from orchestrator.terminal import printable
from sharding.format import DatasetError, WriteError, describe_array, fingerprint
from sharding.writer import DatasetWriter, check_output, existing_ancestor, human_bytes

register_configs()  # before @hydra.main composes `defaults: [prepare_schema, ...]`

Sample = dict[str, np.ndarray]
DEFAULT_BPE_VOCAB = 16384
T = TypeVar("T")


def _no_attributes() -> dict[str, Any]:
    return {}


def _no_note() -> str:
    return ""


@dataclass(frozen=True)
class Source:
    """An input, checked and ready: how many samples, how to stream them, how to name one."""

    kind: str
    path: Path
    num_samples: int  # for the progress bar: exact, or an upper bound (text: skipped documents)
    # Streams the samples; may start worker processes whose lifetime the ExitStack owns.
    open: Callable[[contextlib.ExitStack], Iterator[Sample]]
    describe: Callable[[int], str]  # sample number -> where it came from, for error messages
    files: Mapping[str, bytes] = field(default_factory=dict)  # shipped in the dataset directory
    # The manifest's attributes, asked for once every sample streamed (a corpus counts its tokens
    # on the way), and a line for the user about the input (documents skipped).
    attributes: Callable[[], dict[str, Any]] = _no_attributes
    note: Callable[[], str] = _no_note


@dataclass(frozen=True)
class PrepareResult:
    output: Path
    num_samples: int
    num_shards: int
    num_bytes: int
    seconds: float
    fingerprint: str
    note: str = ""  # what the user should know about the input (documents skipped)

    def __str__(self) -> str:
        rate = self.num_samples / max(self.seconds, 1e-9)
        mb_rate = self.num_bytes / 1e6 / max(self.seconds, 1e-9)
        line = (f"wrote {self.num_samples} samples ({self.num_bytes / 1e6:.1f} MB) in "
                f"{self.num_shards} shards to {self.output} in {self.seconds:.1f} s "
                f"({rate:,.0f} samples/s, {mb_rate:,.1f} MB/s); fingerprint {self.fingerprint}")
        return f"{line}\n{self.note}" if self.note else line


# ------------------------------------------------------------------------------------------------
# Detecting the input


def detect_format(input_path: str, fmt: str) -> tuple[str, Path]:
    """``(kind, path)`` for an input; a Megatron input is returned as its PREFIX (no suffix)."""
    path = Path(input_path).expanduser().absolute()
    if fmt != "auto":
        found = _EXPLICIT[fmt](path)
        if found is None:
            raise invalid("input", input_path, f"is not a {fmt} input ({_EXPECTED[fmt]})",
                          "format=auto, or the right path")
        return fmt, found
    for kind, detect in _AUTO.items():
        found = detect(path)
        if found is not None:
            return kind, found
    why = ("does not exist (nor do PREFIX.bin + PREFIX.idx)" if not path.exists() else
           "is not a recognized input")
    raise invalid("input", input_path, f"{why}; expected {'; or '.join(_EXPECTED.values())}",
                  "input=/path/to/npy_dir")


_EXPECTED = {
    "npy_dir": "a directory of .npy files",
    "pt": "a .pt file holding a list of tensors or of dicts of tensors",
    "megatron": "a Megatron prefix P with P.bin and P.idx",
    "text": "a .txt or .jsonl file, or with format=text a directory of text documents",
    "image_folder": "a directory of class folders of images, DIR/<class>/*.png|jpg|jpeg|npy",
    "hf": "a Hugging Face dataset: a save_to_disk directory, a .parquet file, or with format=hf a .jsonl",
}
TEXT_SUFFIXES = (".txt", ".jsonl")


def _as_npy_dir(path: Path) -> Path | None:
    return path if path.is_dir() else None


def _as_pt(path: Path) -> Path | None:
    return path if path.suffix == ".pt" and path.is_file() else None


def _as_text(path: Path) -> Path | None:
    """A file that says it is text; a directory only with format=text (it could hold anything)."""
    return path if path.suffix.lower() in TEXT_SUFFIXES and path.is_file() else None


def _as_text_or_dir(path: Path) -> Path | None:
    return path if path.is_dir() or path.is_file() else None


def _as_image_folder(path: Path) -> Path | None:
    return path if looks_like_image_folder(path) else None


def _as_dir(path: Path) -> Path | None:
    return path if path.is_dir() else None



def _as_megatron_prefix(path: Path) -> Path | None:
    candidates = [path.with_suffix("")] if path.suffix in (".bin", ".idx") else []
    for prefix in [*candidates, path]:
        if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
            return prefix
    return None


# format=auto tries these in order: an image folder before a .npy directory (both directories).
_AUTO = {"hf": hf_dataset.as_hf, "image_folder": _as_image_folder, "npy_dir": _as_npy_dir,
         "pt": _as_pt, "megatron": _as_megatron_prefix, "text": _as_text}
# An explicit format takes what auto would not guess: any directory as text or an image folder, a
# .jsonl by columns.
_EXPLICIT = {**_AUTO, "text": _as_text_or_dir, "image_folder": _as_dir, "hf": hf_dataset.as_hf_explicit}


def open_source(kind: str, path: Path, cfg: PrepareConfig) -> Source:
    """Check an input fully enough that converting it can only fail on a bad sample."""
    if kind == "npy_dir":
        labels = None if cfg.labels is None else load_labels(cfg.labels, cfg.field)
        return open_npy_dir(path, cfg.field, _num_workers(cfg.num_workers), labels)
    if kind == "image_folder":
        return open_image_folder(path, _num_workers(cfg.num_workers))
    if kind == "pt":
        return open_pt(path, cfg.field)
    if kind == "text":
        return open_text(path, cfg)
    if kind == "hf":
        return open_hf(path, cfg)
    return open_megatron(path, cfg.field)


def check_keys_apply(kind: str, cfg: PrepareConfig) -> None:
    """A key the detected input never reads is refused: tokenizer=bpe on a .npy directory would
    otherwise do nothing, silently."""
    text_only = {"tokenizer": cfg.tokenizer != "bytes", "tokenizer_vocab": cfg.tokenizer_vocab
                 is not None, "eos_token": cfg.eos_token is not None, "skip_bad": cfg.skip_bad}
    hf_only = {"text_field": cfg.text_field is not None, "fields": bool(cfg.fields),
               "label_field": cfg.label_field is not None, "split": cfg.split is not None}
    for key, is_set in hf_only.items():
        if is_set and kind != "hf":
            raise invalid(key, getattr(cfg, key), f"is only read for Hugging Face datasets "
                                                  f"(format=hf), and input={cfg.input!r} is {kind}",
                          f"format=hf, or drop {key}")
    for key, is_set in text_only.items():
        if is_set and not (kind == "text" or (kind == "hf" and cfg.text_field is not None
                                              and key != "skip_bad")):
            raise invalid(key, getattr(cfg, key), f"is only read for text inputs, and input="
                                                  f"{cfg.input!r} is {kind}",
                          f"format=text, or drop {key}")
    if cfg.labels is not None and kind != "npy_dir":
        why = " (its labels are its class folders)" if kind == "image_folder" else ""
        raise invalid("labels", cfg.labels, f"is only read for a directory of .npy files, and "
                                            f"input={cfg.input!r} is {kind}{why}",
                      "drop labels")


def _num_workers(requested: int) -> int:
    return requested if requested > 0 else min(4, len(os.sched_getaffinity(0)))  # the task's cpuset


# ------------------------------------------------------------------------------------------------
# A directory of .npy files


def open_npy_dir(path: Path, field: str, num_workers: int,
                 labels: LabelFile | None = None) -> Source:
    files = list_npy_files(path)
    if not files:
        raise invalid("input", str(path), "is a directory without .npy files (one sample each)",
                      "input=/path/to/dir/of/npy, or format=text for a directory of text "
                      "documents")
    if labels is not None and len(labels.values) != len(files):
        raise invalid("labels", str(labels.path), f"holds {len(labels.values)} labels for the "
                                                  f"{len(files)} .npy files of {path}",
                      "one label per .npy file, in sorted file name order")

    def open_samples(stack: contextlib.ExitStack) -> Iterator[Sample]:
        if num_workers <= 1:
            arrays: Iterator[np.ndarray] = (_load_npy(f) for f in files)
        else:
            arrays = parallel_map(stack, _load_npy, files, num_workers)
        if labels is None:
            return ({field: a} for a in arrays)
        return ({field: a, LABEL_FIELD: y} for a, y in zip(arrays, labels.values, strict=True))

    return Source("npy_dir", path, len(files), open_samples, lambda k: f"file {files[k]}")


def parallel_map(stack: contextlib.ExitStack, fn: Callable[[Any], T], items: Sequence[Any],
                 num_workers: int, chunksize: int = 8) -> Iterator[T]:
    """``fn`` over ``items`` in ``num_workers`` reading processes, the results in order, at most
    two chunks per worker read ahead of the consumer (a slow writer holds no more in memory).

    When ``stack`` closes (the end, or an error such as a file that fails to read) the chunks not
    started are cancelled and the running ones finish: no reader is killed. ``multiprocessing.Pool``
    ended by ``terminate()``, which SIGTERMs its workers; one killed while it held the result
    queue's lock left the pool's task thread waiting on that lock forever, so ``jobs.prepare`` hung
    without a word instead of naming the bad file (about one run in 80 under load, on a full
    suite's run once). fork: the workers need nothing but numpy and start in milliseconds; they are
    forked here, before the progress bar's monitor thread exists. They are born with SIGTERM and
    SIGINT at their defaults: a fork inherits the caller's Python handlers (a training loop's stop
    flag, a program's own), and a reader that only records SIGTERM would outlive a stop."""
    with _default_signals_while_forking():
        executor = ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_default_signals)
        executor.submit(int).result()  # forks every worker now (the fork context starts them all)
    stack.callback(executor.shutdown, wait=True, cancel_futures=True)
    return _in_order(executor, fn, items, num_workers, chunksize)


def _in_order(executor: ProcessPoolExecutor, fn: Callable[[Any], T], items: Sequence[Any],
              num_workers: int, chunksize: int) -> Iterator[T]:
    chunks = (items[i:i + chunksize] for i in range(0, len(items), chunksize))
    pending: collections.deque[tuple[Sequence[Any], Future[list[T]]]] = collections.deque()
    for chunk in chunks:
        pending.append((chunk, executor.submit(_map_chunk, fn, chunk)))
        if len(pending) >= 2 * num_workers:
            yield from _results(*pending.popleft())
    while pending:
        yield from _results(*pending.popleft())


def _results(chunk: Sequence[Any], future: Future[list[T]]) -> list[T]:
    """A chunk's results, or one error line where a reader died (a multiprocessing.Pool waited
    forever for its chunk; the executor knows). The dead reader's chunk is this one or a later one:
    a broken executor fails every chunk not yet returned."""
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise DatasetError(f"a reader process ended without a result (killed, or out of memory) "
                           f"before {chunk[0]} and what follows it were read: nothing was "
                           f"published (run again, or num_workers=1 to read in this process)") from e


def _map_chunk(fn: Callable[[Any], T], chunk: Sequence[Any]) -> list[T]:
    return [fn(item) for item in chunk]


@contextlib.contextmanager
def _default_signals_while_forking() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal.signal works in the main thread only: the initializer does it in each worker
        return
    saved = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def list_npy_files(path: Path) -> list[Path]:
    """The samples of a .npy directory, in name order. An entry named ``*.npy`` that is not a
    regular file is refused, not skipped: skipped, the dataset silently lacked a sample (and a
    FIFO, once opened, would wait forever for a writer)."""
    files = sorted(p for p in path.iterdir() if p.suffix == ".npy")
    for f in files:
        if not f.is_file():
            raise DatasetError(f"{f}: is {_entry_kind(f)}, not a .npy file (one sample each): "
                               f"remove it or rename it")
    return files


def _entry_kind(path: Path) -> str:
    if path.is_dir():
        return "a directory"
    if path.is_fifo():
        return "a FIFO"
    return "a broken symbolic link" if not path.exists() else "not a regular file"


LABEL_FIELD = "y"


@dataclass(frozen=True)
class LabelFile:
    path: Path
    values: np.ndarray  # [num_files]: int64 class labels, or float32 regression targets


def load_labels(path_text: str, field: str) -> LabelFile:
    """``labels=FILE.npy``: a 1-D array, one label per .npy file in sorted name order; integers
    are stored as int64 (class labels), floats as float32 (regression targets)."""
    path = Path(path_text).expanduser().absolute()
    if field == LABEL_FIELD:
        raise invalid("field", field, f"is the labels' field {LABEL_FIELD!r}", "field=x")
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise invalid("labels", path_text, f"is not a readable .npy array ({e})",
                      "labels=/path/to/labels.npy") from e
    if values.ndim != 1 or values.dtype.kind not in "iuf":
        raise invalid("labels", path_text, f"holds {describe_array(values)}, expected a 1-D "
                                           f"integer (or float) array",
                      "np.save(path, np.asarray(labels, dtype=np.int64))")
    kept = values.astype(np.int64 if values.dtype.kind in "iu" else np.float32)
    return LabelFile(path, kept)


def _load_npy(path: Path) -> np.ndarray:
    """One sample; runs in a worker process, so its error must pickle (a plain message does)."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty or truncated file
        raise DatasetError(f"{path}: not a readable .npy array ({type(e).__name__}: {e}); "
                           f"fix or remove it") from e


# ------------------------------------------------------------------------------------------------
# A .pt file


def open_pt(path: Path, field: str) -> Source:
    import torch  # deferred: the other inputs do not need torch's 2 s import

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types: pickle, zip, unsupported global...
        raise invalid("input", str(path), f"cannot be loaded with torch.load(weights_only=True) "
                                          f"({type(e).__name__}: {e})",
                      "a file written by torch.save(list_of_tensors, path)") from e
    items = _check_pt_items(obj, path)

    def open_samples(stack: contextlib.ExitStack) -> Iterator[Sample]:
        for k, item in enumerate(items):
            fields = item if isinstance(item, Mapping) else {field: item}
            yield {name: _tensor_to_numpy(t, k, name) for name, t in fields.items()}

    return Source("pt", path, len(items), open_samples, lambda k: f"item {k} of {path}")


def _check_pt_items(obj: object, path: Path) -> Sequence[Any]:
    """A non-empty list of tensors, or of dicts str -> tensor; anything else is refused."""
    import torch

    expected = "a list of tensors or a list of dicts of tensors"
    if not isinstance(obj, list | tuple) or not obj:
        what = "an empty list" if isinstance(obj, list | tuple) else f"a {type(obj).__name__}"
        raise invalid("input", str(path), f"holds {what}, expected {expected}",
                      "torch.save([tensor, ...], path)")
    as_dicts = isinstance(obj[0], Mapping)
    for k, item in enumerate(obj):
        ok = (isinstance(item, Mapping) and all(
            isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in item.items())
        ) if as_dicts else isinstance(item, torch.Tensor)
        if not ok:
            raise invalid("input", str(path), f"item {k} is a {type(item).__name__} while item 0 "
                                              f"is a {type(obj[0]).__name__}; expected {expected}",
                          "one kind of item throughout")
    return obj


def _tensor_to_numpy(tensor: Any, number: int, name: str) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        raise DatasetError(f"sample {number}, field {name!r}: bfloat16 has no numpy dtype; "
                           f"save it as .float() (or .view(torch.int16) to keep the bits)")
    return tensor.detach().numpy()  # a view of the (memory-mapped) tensor, no copy


# ------------------------------------------------------------------------------------------------
# A Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx), read from its documented layout

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# magic, version (=1), dtype code, sequence count, document count; then int32 sequence lengths
# (elements), int64 sequence pointers (bytes into .bin), int64 document indices. 34 bytes.
MEGATRON_HEADER = struct.Struct("<9sQBQQ")
MEGATRON_DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
    7: np.float32, 8: np.uint16,
}


@dataclass(frozen=True)
class MegatronIndex:
    dtype: np.dtype[Any]
    lengths: np.ndarray  # int32 [num_sequences]: elements per sequence
    pointers: np.ndarray  # int64 [num_sequences]: byte offset of each sequence in PREFIX.bin


def read_megatron_index(idx_path: Path, bin_bytes: int) -> MegatronIndex:
    """Parse and check a Megatron .idx (where Megatron itself only asserts)."""
    with open(idx_path, "rb") as f:
        head = f.read(MEGATRON_HEADER.size)
    if len(head) < MEGATRON_HEADER.size:
        raise _bad_megatron(idx_path, f"is {len(head)} bytes, shorter than the 34-byte header")
    magic, version, code, num_seqs, num_docs = MEGATRON_HEADER.unpack(head)
    if magic != MEGATRON_MAGIC or version != 1:
        raise _bad_megatron(idx_path, f"has magic {magic!r} version {version}, expected "
                                      f"{MEGATRON_MAGIC!r} version 1")
    if code not in MEGATRON_DTYPES:
        raise _bad_megatron(idx_path, f"has dtype code {code}, expected one of "
                                      f"{sorted(MEGATRON_DTYPES)}")
    need = MEGATRON_HEADER.size + 12 * num_seqs + 8 * num_docs
    if idx_path.stat().st_size < need or num_seqs == 0:
        raise _bad_megatron(idx_path, f"is {idx_path.stat().st_size} bytes for {num_seqs} "
                                      f"sequences and {num_docs} documents (needs {need}, and "
                                      f"at least one sequence)")
    # Read with explicit offsets: Megatron's arrays start at byte 34, not 8-byte aligned.
    lengths = np.fromfile(idx_path, "<i4", num_seqs, offset=MEGATRON_HEADER.size)
    pointers = np.fromfile(idx_path, "<i8", num_seqs, offset=MEGATRON_HEADER.size + 4 * num_seqs)
    index = MegatronIndex(np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<"), lengths, pointers)
    _check_megatron_bounds(index, idx_path, bin_bytes)
    return index


def _check_megatron_bounds(index: MegatronIndex, idx_path: Path, bin_bytes: int) -> None:
    item = index.dtype.itemsize
    ends = index.pointers + index.lengths.astype(np.int64) * item
    bad = (index.lengths < 0) | (index.pointers < 0) | (index.pointers % item != 0) | (
        ends > bin_bytes)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise _bad_megatron(idx_path, f"sequence {k} (pointer {index.pointers[k]}, "
                                      f"{index.lengths[k]} elements) lies outside the "
                                      f"{bin_bytes}-byte .bin, or is misaligned")


def _bad_megatron(path: Path, what: str) -> ConfigError:
    return invalid("input", str(path), f"{what}: not a readable Megatron MMapIndexedDataset",
                   "the PREFIX of a PREFIX.bin/PREFIX.idx pair written by Megatron-LM")


def open_megatron(prefix: Path, field: str) -> Source:
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    bin_bytes = bin_path.stat().st_size
    index = read_megatron_index(idx_path, bin_bytes)

    def open_samples(stack: contextlib.ExitStack) -> Iterator[Sample]:
        if bin_bytes == 0:  # every sequence is empty; an empty file cannot be mapped
            flat = np.zeros(0, index.dtype)
        else:
            flat = np.memmap(bin_path, index.dtype, mode="r").view(np.ndarray)
        starts = index.pointers // index.dtype.itemsize
        for begin in range(0, len(starts), 65536):  # Python ints in chunks, not 1e8 at once
            for start, length in zip(starts[begin:begin + 65536].tolist(),
                                     index.lengths[begin:begin + 65536].tolist(), strict=True):
                yield {field: flat[start:start + length]}

    return Source("megatron", prefix, len(index.lengths), open_samples,
                  lambda k: f"sequence {k} of {prefix}.bin")


# ------------------------------------------------------------------------------------------------
# An image folder


def open_image_folder(path: Path, num_workers: int) -> Source:
    """``DIR/<class>/*`` -> ``x`` uint8 ``[C, H, W]`` and ``y`` int64 (``jobs/image_folder.py``);
    the class names, in label order, go into the manifest's attributes."""
    classes, items, skipped = list_images(path)
    files = [f for f, _ in items]

    def open_samples(stack: contextlib.ExitStack) -> Iterator[Sample]:
        if num_workers <= 1:
            images: Iterator[np.ndarray] = (load_image(f) for f in files)
        else:  # decoding is the cost: several processes, in order, as for .npy directories
            images = parallel_map(stack, load_image, files, num_workers)
        return _image_samples(images, items)

    return Source("image_folder", path, len(items), open_samples, lambda k: f"file {files[k]}",
                  attributes=lambda: {"classes": classes}, note=lambda: skipped_note(path, skipped))


def _image_samples(images: Iterator[np.ndarray], items: list[tuple[Path, int]]
                   ) -> Iterator[Sample]:
    first: np.ndarray | None = None
    for image, (path, label) in zip(images, items, strict=False):
        if first is None:
            first = image
        check_same_shape(image, first, path, items[0][0])
        yield {"x": image, LABEL_FIELD: np.array(label, dtype=np.int64)}


# ------------------------------------------------------------------------------------------------
# A text corpus


def open_text(path: Path, cfg: PrepareConfig) -> Source:
    """Documents -> one ``tokens`` sample each; a BPE is trained here, in a first pass, so a bad
    document stops it before any output exists."""
    corpus = Corpus(corpus_files(path), cfg.skip_bad)
    num_documents = count_documents(corpus.files)
    tokenizer = text_tokenizer(cfg, corpus, num_documents)
    count = TokenCount()

    def attributes() -> dict[str, Any]:
        return {"tokenizer": tokenizer.attributes(), "num_documents": count.num_documents,
                "num_tokens": count.num_tokens, "max_token_id": count.max_token_id}

    files = {} if tokenizer.json_bytes is None else {TOKENIZER_FILE: tokenizer.json_bytes}
    return Source("text", path, num_documents, lambda stack: token_samples(corpus, tokenizer, count),
                  lambda k: f"document {count.current}", files, attributes, corpus.skipped_note)


def open_hf(path: Path, cfg: PrepareConfig) -> Source:
    """One split of a Hugging Face dataset: its text column tokenized, or its columns as arrays.
    The split, the columns and the first row are checked before any output exists."""
    table = hf_dataset.open_table(path, cfg.split)
    hf_dataset.check_columns(table, cfg)
    hf_dataset.check_first_row(table, cfg)
    if cfg.text_field is not None:
        corpus = hf_dataset.RowCorpus(table, cfg.text_field)
        tokenizer = text_tokenizer(cfg, corpus, table.num_rows)
        count = TokenCount()

        def attributes() -> dict[str, Any]:
            return {"tokenizer": tokenizer.attributes(), "num_documents": count.num_documents,
                    "num_tokens": count.num_tokens, "max_token_id": count.max_token_id}

        files = {} if tokenizer.json_bytes is None else {TOKENIZER_FILE: tokenizer.json_bytes}
        return Source("hf", path, table.num_rows, lambda stack: token_samples(corpus, tokenizer, count),
                      lambda k: f"row {k}", files, attributes)
    classes = hf_dataset.classes(table, cfg.label_field)
    return Source("hf", path, table.num_rows,
                  lambda stack: hf_dataset.row_samples(table, list(cfg.fields), cfg.label_field),
                  lambda k: f"row {k}", attributes=lambda: {"classes": classes} if classes else {})


def text_tokenizer(cfg: PrepareConfig, corpus: Corpus, num_documents: int) -> TextTokenizer:
    if cfg.tokenizer == "bytes":
        return bytes_tokenizer()
    if cfg.tokenizer == "bpe":
        return train_bpe(corpus, cfg.tokenizer_vocab or DEFAULT_BPE_VOCAB, num_documents)
    if Path(cfg.tokenizer).expanduser().is_dir():  # a prepared dataset: its own tokenizer
        return dataset_tokenizer(Path(cfg.tokenizer).expanduser(), cfg.eos_token)
    return load_tokenizer(cfg.tokenizer, cfg.eos_token)


# ------------------------------------------------------------------------------------------------
# Converting


def prepare(cfg: PrepareConfig) -> PrepareResult:
    """Check the input and the output, then stream every sample into a new dataset."""
    kind, path = detect_format(cfg.input, cfg.format)
    check_keys_apply(kind, cfg)
    output = Path(cfg.output).expanduser().absolute()
    if output.is_symlink():  # a link to a dataset: replaced where it lies (DatasetWriter does the same)
        output = output.resolve()
    check_input_outside(kind, path, output, cfg.labels)
    check_output(output, cfg.overwrite)
    check_space(output, dataset_bytes(kind, path, cfg.tokenizer))
    source = open_source(kind, path, cfg)
    return convert(source, output, cfg.shard_bytes, cfg.overwrite)


def check_input_outside(kind: str, path: Path, output: Path, labels: str | None = None) -> None:
    """An input inside the output would be deleted by the publish that replaces the output (or,
    for a new output, be the directory the dataset is renamed onto): refuse it first."""
    inputs = [Path(f"{path}.bin"), Path(f"{path}.idx")] if kind == "megatron" else [path]
    if labels is not None:
        inputs.append(Path(labels).expanduser().absolute())
    target = output.resolve()
    for item in inputs:
        resolved = item.resolve()
        if resolved == target or target in resolved.parents:
            raise ConfigError(f"input={str(item)!r} is inside output={str(output)!r}: writing the "
                              f"dataset there would delete its own input (move the input out, or "
                              f"choose another output)")


def dataset_bytes(kind: str, path: Path, tokenizer: str) -> int:
    """About the dataset's size: the input's, or twice it for text stored a uint16 per byte."""
    if kind == "text":
        size = sum(f.stat().st_size for f in corpus_files(path))
        return 2 * size if tokenizer == "bytes" else size
    return input_bytes(kind, path)


def input_bytes(kind: str, path: Path) -> int:
    """The input's size on disk: the samples' bytes, which the dataset holds again (plus padding)."""
    if kind == "megatron":
        return Path(f"{path}.bin").stat().st_size
    if kind == "image_folder":  # a lower bound: compressed images decode to more
        _, items, _ = list_images(path)
        return sum(f.stat().st_size for f, _ in items)
    if kind == "hf" and path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*.arrow"))
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.npy"))
    return path.stat().st_size


def check_space(output: Path, needed: int) -> None:
    """Refuse now an output whose file system cannot hold the dataset, instead of at the full disk
    an hour in. The dataset is about the input's size; a smaller free space cannot fit it."""
    existing = existing_ancestor(output.parent)
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise DatasetError(f"output={str(output)!r}: the dataset needs about {human_bytes(needed)} "
                           f"(the input's size) and {existing} has {human_bytes(free)} free "
                           f"(free space there, or choose another output)")


def convert(source: Source, output: Path, shard_bytes: int, overwrite: bool) -> PrepareResult:
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        samples = source.open(stack)
        writer = stack.enter_context(DatasetWriter(output, shard_bytes=shard_bytes,
                                                   overwrite=overwrite))
        for name, data in source.files.items():
            writer.add_file(name, data)
        bar = stack.enter_context(tqdm(total=source.num_samples, unit="sample", unit_scale=True,
                                       desc=f"prepare {source.kind}", mininterval=0.5))
        for number, sample in enumerate(samples):
            _append(writer, sample, source, number)
            bar.update(1)
            if number % 512 == 0:
                mb_per_s = writer.num_bytes / 1e6 / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{mb_per_s:,.1f} MB/s", refresh=False)
        bar.total = bar.n  # the count was an upper bound where documents are blank or skipped
        bar.refresh()
        writer.attributes = source.attributes()
        num_samples, num_bytes = writer.num_samples, writer.num_bytes
    manifest = writer.manifest
    assert manifest is not None  # the writer published on leaving the with block
    return PrepareResult(output, num_samples, len(manifest.shards), num_bytes,
                         time.perf_counter() - start, fingerprint(manifest), source.note())


def _append(writer: DatasetWriter, sample: Sample, source: Source, number: int) -> None:
    try:
        writer.append(sample)
    except WriteError:
        raise  # the output's file system failed: which input sample it was writing is no help
    except DatasetError as e:
        e.add_note(f"input: {source.describe(number)}")
        raise


def to_config(cfg: DictConfig) -> PrepareConfig:
    """DictConfig -> the typed PrepareConfig (its __post_init__ checks run here)."""
    try:
        config = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required: python -m jobs.prepare input=PATH "
                          f"output=PATH") from e
    except OmegaConfBaseException as e:  # an interpolation to no key, a string for a number
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or omegaconf_error(e) from e
    if not isinstance(config, PrepareConfig):  # a wrong `defaults:` list in conf/prepare.yaml
        raise ConfigError(f"conf/prepare.yaml built a {type(config).__name__}, not a "
                          f"PrepareConfig: its defaults must start with prepare_schema")
    return config


def _message(error: BaseException) -> str:
    return "\n".join([str(error), *getattr(error, "__notes__", [])])


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="prepare")
@hydra_task
def main(cfg: DictConfig) -> None:
    try:
        result = prepare(to_config(cfg))
    except (ConfigError, DatasetError, OSError) as e:
        # A one-line reason instead of Hydra's traceback: these are the user's input or file
        # system (an unreadable input file, a full disk), not a bug. The writer has already
        # removed its partial copy; an OSError names its file.
        raise SystemExit(f"jobs.prepare: error: {printable(_message(e))}") from e
    print(result)


if __name__ == "__main__":
    hydra_app(main, sys.argv, prefix="jobs.prepare: ")
