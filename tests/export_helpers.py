"""What the export tests share: a small BPE-tokenized text dataset, as a user would prepare one."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def bpe_dataset(root: Path) -> Path:
    """Two stdlib modules as a byte-level BPE of 300 ids (jobs.prepare stores its tokenizer.json)."""
    source = root / "src"
    source.mkdir()
    for name in ("textwrap.py", "string.py"):
        (source / name).write_bytes((STDLIB / name).read_bytes())
    proc = subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={source}", f"output={root / 'bpe'}",
                           "format=text", "tokenizer=bpe", "tokenizer_vocab=300"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return root / "bpe"
