"""Real text for the language-model benchmarks, from what every python has: its standard library."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from sharding import DatasetWriter

BYTES_TOKENIZER = {"kind": "bytes", "vocab_size": 257, "eos_id": 256, "file": None}


def byte_corpus(path: Path) -> Path:
    """The standard library's top-level sources (4.7 MB on Python 3.11) as byte tokens, one
    document per file with EOS 256 appended: what ``jobs.prepare format=text tokenizer=bytes``
    writes, without needing the tokenizers package (a GPU node may lack it)."""
    with DatasetWriter(path, attributes={"tokenizer": BYTES_TOKENIZER}) as writer:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            data = np.frombuffer(source.read_bytes(), dtype=np.uint8).astype(np.uint16)
            writer.append({"tokens": np.append(data, np.uint16(256))})
    return path
