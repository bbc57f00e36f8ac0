"""Text corpora for ``jobs.prepare format=text``: documents streamed from files, and tokenizers.

A corpus is a ``.txt`` file (one document), a ``.jsonl`` file (one document per line, its
``text`` field), or a directory read recursively in sorted path order (each file one document,
each ``.jsonl`` file one per line; names starting with ``.`` are skipped, as ``.git`` is not
text). Documents are read one at a time, so a corpus of any size streams.

Tokenizers turn a document into ids; every document is stored with the EOS id appended, so a
trainer packing documents back to back finds EOS between them:

- ``bytes``: the UTF-8 bytes, ids 0..255, EOS 256, vocabulary 257. Needs nothing.
- ``bpe``: a byte-level BPE of ``tokenizer_vocab`` ids trained on this corpus (one extra pass),
  with EOS ``<|endoftext|>``; its ``tokenizer.json`` is stored in the dataset.
- a path to a Hugging Face ``tokenizer.json``: used as is, EOS found by name (``eos_token``);
  a copy is stored in the dataset, so the dataset alone decodes its tokens.
- a prepared dataset's directory (``tokenizer=data/lm_train``): the tokenizer it records, its own
  ``tokenizer.json`` byte for byte and its EOS id, so an eval set is tokenized as its training set
  was (``jobs.train`` refuses an eval set whose tokenizer differs from the training set's).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from orchestrator.config import ConfigError, invalid
from sharding.format import DatasetError, read_manifest

BYTES_EOS_ID = 256
BYTES_VOCAB_SIZE = 257
BPE_EOS_TOKEN = "<|endoftext|>"
# EOS tokens of common tokenizers, tried in this order when eos_token is not given.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"  # the name a tokenizer is stored under in the dataset
TEXT_FIELD = "tokens"  # the one field of a text dataset: uint16 or uint32 [*], EOS last
# Documents per tokenizers.encode_batch call (its Rust threads share the work), and at most this
# many characters: 64 large documents at once would hold gigabytes.
ENCODE_BATCH = 64
ENCODE_BATCH_CHARS = 16 * 2**20


class BadDocument(DatasetError):
    """A document that is not UTF-8 text (or a .jsonl line without a string "text")."""

    def __init__(self, where: str, why: str, fix: str):
        super().__init__(f"{where}: {why}; {fix}, or skip such documents with skip_bad=true")
        self.short = f"{where}: {why}"  # for the count of skipped ones, where the fix is moot


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The smallest unsigned dtype that holds every id below ``vocab_size``: uint16 up to 65536
    ids (half the bytes of uint32, and every common vocabulary fits), else uint32."""
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ConfigError(f"a vocabulary of {vocab_size} ids does not fit uint32: use a tokenizer "
                      f"with at most {2**32} ids")


# ------------------------------------------------------------------------------------------------
# Documents


def corpus_files(path: Path) -> list[Path]:
    """The files of a corpus in the order their documents are stored: sorted by path."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise invalid("input", str(path), "is a directory without files (text documents)",
                      "input=/path/to/corpus")
    return files


def count_documents(files: Sequence[Path]) -> int:
    """Documents in the corpus, for the progress bar: one per file, one per line of a .jsonl
    (counted from its bytes, so blank lines count: an upper bound)."""
    return sum(_count_lines(f) if _is_jsonl(f) else 1 for f in files)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    return lines + (last != b"\n")


@dataclass
class Corpus:
    """The documents of some files, streamed; bad ones refused, or skipped with ``skip_bad``."""

    files: list[Path]
    skip_bad: bool
    num_skipped: int = 0  # in the last pass over the documents
    first_skipped: str = ""

    def documents(self) -> Iterator[str]:
        """Every good document in order; each pass counts its skipped documents afresh."""
        for _, text in self.located_documents():
            yield text

    def located_documents(self) -> Iterator[tuple[str, str]]:
        """(where, text) of every good document, in order."""
        self.num_skipped, self.first_skipped = 0, ""
        for path in self.files:
            for where, raw in _raw_documents(path):
                try:
                    text = _decode(raw, where, _is_jsonl(path))
                except BadDocument as e:
                    if not self.skip_bad:
                        raise
                    self.num_skipped += 1
                    self.first_skipped = self.first_skipped or e.short
                    continue
                yield where, text

    def skipped_note(self) -> str:
        if not self.num_skipped:
            return ""
        return (f"skipped {self.num_skipped} bad document(s) (skip_bad=true), the first: "
                f"{self.first_skipped}")


def _raw_documents(path: Path) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of each document of one file: the file, or each non-blank .jsonl line."""
    if not _is_jsonl(path):
        yield str(path), path.read_bytes()
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield f"{path} line {number}", line


def _decode(raw: bytes, where: str, is_jsonl: bool) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadDocument(where, f"not UTF-8 text (byte {e.start}: "
                                 f"{raw[e.start:e.start + 1]!r})",
                          "convert it to UTF-8, remove it") from e
    if not is_jsonl:
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadDocument(where, f"not JSON ({e})", "fix the line") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise BadDocument(where, "expected a JSON object with a string \"text\" field",
                          "fix the line")
    value: str = record["text"]
    return value


# ------------------------------------------------------------------------------------------------
# Tokenizers


@dataclass(frozen=True)
class TextTokenizer:
    """Documents -> token ids (EOS not included), and what a trainer needs to know about it."""

    kind: str  # bytes | huggingface | bpe: the manifest's attributes.tokenizer.kind
    vocab_size: int
    eos_id: int
    encode_batch: Callable[[list[str]], list[np.ndarray]]
    json_bytes: bytes | None = None  # the tokenizer.json stored in the dataset; None for bytes

    def attributes(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "file": TOKENIZER_FILE if self.json_bytes is not None else None}


def bytes_tokenizer() -> TextTokenizer:
    def encode(texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    return TextTokenizer("bytes", BYTES_VOCAB_SIZE, BYTES_EOS_ID, encode)


def load_tokenizer(path_text: str, eos_token: str | None) -> TextTokenizer:
    """A Hugging Face tokenizer.json given by path; the exact bytes read are the ones stored."""
    from tokenizers import Tokenizer  # deferred: only text inputs with such a tokenizer need it

    path = Path(path_text).expanduser()
    try:
        data = path.read_bytes()
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # OSError, UnicodeDecodeError, and tokenizers' plain Exception
        raise invalid("tokenizer", path_text, f"cannot be loaded as a Hugging Face tokenizer.json "
                                              f"({type(e).__name__}: {e})",
                      "tokenizer=bytes, tokenizer=bpe, or the path of a tokenizer.json") from e
    return _huggingface(tokenizer, "huggingface", _eos_id(tokenizer, eos_token, path_text), data)


def dataset_tokenizer(path: Path, eos_token: str | None) -> TextTokenizer:
    """The tokenizer a prepared dataset records: kind, EOS id and ``tokenizer.json`` as they are."""
    fix = "tokenizer=DIR of a dataset written by jobs.prepare format=text"
    try:
        manifest = read_manifest(path)
    except DatasetError as e:
        raise invalid("tokenizer", str(path), f"is a directory but no dataset: {e}", fix) from e
    recorded = manifest.attributes.get("tokenizer")
    if not isinstance(recorded, dict):
        raise invalid("tokenizer", str(path), "is a dataset that records no tokenizer", fix)
    if eos_token is not None:
        raise invalid("eos_token", eos_token, f"is not read with tokenizer={path}: the dataset's "
                                              f"EOS id {recorded.get('eos_id')} is used", "drop eos_token")
    if recorded.get("kind") == "bytes":
        return bytes_tokenizer()
    from tokenizers import Tokenizer  # deferred: only text inputs with such a tokenizer need it

    data = (path / str(recorded.get("file"))).read_bytes()
    tokenizer = _huggingface(Tokenizer.from_str(data.decode("utf-8")), str(recorded["kind"]),
                             int(recorded["eos_id"]), data)
    if tokenizer.vocab_size != recorded.get("vocab_size"):
        raise invalid("tokenizer", str(path), f"records a vocabulary of {recorded.get('vocab_size')} "
                                              f"ids but its {recorded.get('file')} has "
                                              f"{tokenizer.vocab_size}", "prepare that dataset again")
    return tokenizer


def _eos_id(tokenizer: Any, eos_token: str | None, where: str) -> int:
    candidates = (eos_token,) if eos_token is not None else KNOWN_EOS_TOKENS
    for token in candidates:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()][:10]
    what = (f"has no token {eos_token!r}" if eos_token is not None else
            f"has none of the usual EOS tokens {list(KNOWN_EOS_TOKENS)}")
    # Quoted as the shell must pass it: Hydra's override grammar refuses a bare < or |.
    raise invalid("tokenizer", where, f"{what}; its added tokens are {specials}",
                  f"'eos_token=\"{specials[0] if specials else '<|endoftext|>'}\"'")


def _huggingface(tokenizer: Any, kind: str, eos_id: int, data: bytes) -> TextTokenizer:
    # Text that spells an added token ("<|endoftext|>" inside a web page) is encoded as text:
    # only the EOS this job appends may mark a document's end.
    tokenizer.encode_special_tokens = True
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    dtype = token_dtype(vocab_size)

    def encode(texts: list[str]) -> list[np.ndarray]:
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=dtype) for e in encoded]

    return TextTokenizer(kind, vocab_size, eos_id, encode, data)


def train_bpe(corpus: Corpus, vocab_size: int, num_documents: int) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` ids trained on the corpus (every byte is in its
    alphabet, so any text encodes and decodes back exactly), EOS ``<|endoftext|>`` at id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with tqdm(total=num_documents, unit="doc", desc="train bpe", mininterval=0.5) as bar:
        tokenizer.train_from_iterator(_counted(corpus.documents(), bar), trainer,
                                      length=num_documents)
    data = tokenizer.to_str().encode("utf-8")
    return _huggingface(tokenizer, "bpe", _eos_id(tokenizer, BPE_EOS_TOKEN, "bpe"), data)


def _counted(documents: Iterator[str], bar: tqdm[Any]) -> Iterator[str]:
    for text in documents:
        bar.update(1)
        yield text


@dataclass
class TokenCount:
    """What a text dataset holds, counted while its samples stream past."""

    num_documents: int = 0
    num_tokens: int = 0  # EOS included: the length of all documents packed back to back
    max_token_id: int = 0  # the largest id written: a model's vocabulary must exceed it
    current: str = ""  # where the document last handed to the writer came from


def token_samples(corpus: Corpus, tokenizer: TextTokenizer, count: TokenCount
                  ) -> Iterator[dict[str, np.ndarray]]:
    """``{"tokens": ids + [EOS]}`` per document, in the tokenizer's dtype, in corpus order."""
    dtype = token_dtype(tokenizer.vocab_size)
    batch: list[tuple[str, str]] = []
    num_chars = 0
    for where, text in corpus.located_documents():
        batch.append((where, text))
        num_chars += len(text)
        if len(batch) == ENCODE_BATCH or num_chars >= ENCODE_BATCH_CHARS:
            yield from _with_eos(batch, tokenizer, dtype, count)
            batch, num_chars = [], 0
    if batch:
        yield from _with_eos(batch, tokenizer, dtype, count)


def _with_eos(batch: list[tuple[str, str]], tokenizer: TextTokenizer, dtype: np.dtype[Any],
              count: TokenCount) -> Iterator[dict[str, np.ndarray]]:
    encoded = tokenizer.encode_batch([text for _, text in batch])
    for (where, _), ids in zip(batch, encoded, strict=True):
        tokens = np.empty(len(ids) + 1, dtype)  # [len + 1]
        tokens[:-1] = ids
        tokens[-1] = tokenizer.eos_id
        count.num_documents += 1
        count.num_tokens += len(tokens)
        count.max_token_id = max(count.max_token_id, int(tokens.max()))
        count.current = where
        yield {TEXT_FIELD: tokens}
