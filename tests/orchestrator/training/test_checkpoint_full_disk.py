"""A checkpoint save on a full disk, for real (a 64 KiB tmpfs): one line naming the checkpoint, the
system's reason, the free space and the fix, in both formats (issue 34 item 11: under fsdp the
error was ``CheckpointException ranks:dict_keys([0, 1])``, with neither path nor cause). The
checkpoints before it are kept, and nothing partial is left to hold the space."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from orchestrator.training import checkpoint, runtime, sharded_checkpoint
from orchestrator.training.checkpoint import CheckpointError

FIX = ("(free space there, keep fewer with checkpoint.keep_last, or set checkpoint.dir to a file "
       "system with room)")


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB file system: a small checkpoint fits, a 256 KiB one does not."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount / "checkpoints"
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def refusal(path: Path) -> str:
    """The line for ``path``. Its reason is the OSError, or torch's short write where DCP pickled
    the failure (which drops the OSError it was raised from)."""
    reason = (r"(No space left on device|a write came up short \(torch's writer: unexpected pos \d+ vs "
              r"\d+\), as on a full disk or quota)")
    return (rf"^cannot save checkpoint {re.escape(str(path))}: {reason} \([0-9.]+ MiB free there\); it "
            rf"was not published, and the checkpoints before it are kept {re.escape(FIX)}$")


def test_a_ddp_save_on_a_full_disk_names_the_path_the_space_and_the_fix(full_disk: Path) -> None:
    checkpoint.save(full_disk, 1, {"step": 1, "w": torch.zeros(16)}, keep_last=2)
    with pytest.raises(CheckpointError, match=refusal(checkpoint.path_for(full_disk, 3))):
        checkpoint.save(full_disk, 3, {"step": 3, "w": torch.zeros(1 << 16)}, keep_last=2)
    assert sorted(p.name for p in full_disk.iterdir()) == ["step-000000001.pt", "step-000000001.pt.xxh3"]
    found = checkpoint.load_latest(full_disk)
    assert found is not None and found.step == 1


def test_an_fsdp_save_on_a_full_disk_names_the_path_the_space_and_the_fix(
        rank: runtime.Runtime, full_disk: Path) -> None:
    sharded_checkpoint.save(full_disk, 1, {"model": {"w": torch.zeros(16)}}, {"step": 1}, keep_last=2)
    with pytest.raises(CheckpointError, match=refusal(sharded_checkpoint.path_for(full_disk, 3))):
        sharded_checkpoint.save(full_disk, 3, {"model": {"w": torch.zeros(1 << 16)}}, {"step": 3},
                                keep_last=2)
    assert sorted(p.name for p in full_disk.iterdir()) == ["step-000000001.dcp"]  # no partial left
    assert sharded_checkpoint.train_state(full_disk / "step-000000001.dcp")["step"] == 1


def test_a_failure_that_is_not_the_file_system_passes_unchanged(tmp_path: Path) -> None:
    assert checkpoint.save_failed(tmp_path / "step-000000001.pt", RuntimeError("a bug")) is None
    with pytest.raises(AttributeError, match="pickle"):  # a state torch cannot pickle
        checkpoint.save(tmp_path, 1, {"step": 1, "f": lambda: 0}, keep_last=2)
