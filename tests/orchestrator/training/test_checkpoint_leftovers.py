"""The ddp checkpoint directory: a save killed mid-write leaves a temp file, which the next save
removes, and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from orchestrator.training import checkpoint


def test_a_killed_checkpoint_save_leaves_nothing_after_the_next_save(tmp_path: Path) -> None:
    """Before: a ddp save killed mid-write left .step-N.pt.XXXX.tmp (50 MB in the report) for good."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    leftovers = [directory / ".step-000000040.pt.k2j_9x.tmp",
                 directory / ".step-000000040.pt.xxh3.ab12cd.tmp"]
    for path in leftovers:
        path.write_bytes(os.urandom(64))
    users = [directory / "notes.tmp", directory / ".step-notes.tmp"]
    for path in users:
        path.write_text("mine")
    checkpoint.save(directory, 50, {"step": 50, "w": torch.zeros(3)}, keep_last=2)
    assert not any(p.exists() for p in leftovers)
    assert all(p.read_text() == "mine" for p in users)
    assert checkpoint.load_latest(directory).step == 50  # type: ignore[union-attr]
