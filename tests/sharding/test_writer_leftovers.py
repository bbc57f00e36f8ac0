"""What a writer leaves when the process or the disk fails under it: a killed writer's temp
directory is removed by the next writer (a live one's never), and a full disk is one clear error
with nothing published and nothing left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sharding import DatasetError, DatasetWriter, open_dataset
from sharding.writer import remove_stale_siblings

SLOW_WRITER = """
import sys, time, numpy as np
from sharding import DatasetWriter
with DatasetWriter(sys.argv[1]) as w:
    while True:
        w.append({"x": np.zeros((256, 64), np.float32)})
        time.sleep(0.001)
"""


def leftovers(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*"))


def test_a_killed_writers_temp_directory_is_removed_by_the_next_writer(tmp_path: Path) -> None:
    """Before: a prepare killed with kill -9 left its .NAME.tmp-* (49 MB in the report) for good."""
    out = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(out)])
    try:
        deadline = time.monotonic() + 60
        while not any(p.is_dir() and any(p.iterdir()) for p in leftovers(out)):
            assert time.monotonic() < deadline and proc.poll() is None, "the writer never wrote"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    [stale] = leftovers(out)
    with DatasetWriter(out) as writer:
        assert not stale.exists()
        writer.append({"x": np.ones((2, 64), np.float32)})
    assert leftovers(out) == [] and len(open_dataset(out)) == 1


def test_a_live_writers_temp_directory_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    first = DatasetWriter(out)
    first.append({"x": np.ones((2, 4), np.float32)})
    [mine] = leftovers(out)
    assert remove_stale_siblings(out) == []
    with DatasetWriter(tmp_path / "other") as other:
        other.append({"x": np.ones((1, 4), np.float32)})
    second = DatasetWriter(out)
    assert mine.exists()
    second.abort()
    first.close()
    assert len(open_dataset(out)) == 1


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (this project's machines and CI run as root)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs for the full-disk test: {mounted.stderr}")
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)  # even if a file is still open


def test_a_full_disk_is_one_error_naming_the_output_and_leaves_nothing(tmp_path: Path) -> None:
    """Before: a raw OSError: [Errno 28] without the output path, from the middle of the writer."""
    with small_filesystem(tmp_path / "small", "2m") as small:
        out = small / "ds"
        writer = DatasetWriter(out, shard_bytes=256 * 1024)
        with pytest.raises(DatasetError) as caught:
            for _ in range(1000):  # 64 KB a sample: the 2 MB file system fills after ~30
                writer.append({"x": np.ones((256, 64), np.float32)})
            writer.close()
        message = str(caught.value)
        assert message.startswith(f"cannot write {out}: No space left on device after ")
        assert "free there; nothing was published and the partial copy was removed" in message
        assert "free space on that file system, or choose another output" in message
        assert list(small.iterdir()) == []


def test_prepare_refuses_an_output_too_small_for_the_input_before_writing(tmp_path: Path) -> None:
    npy = tmp_path / "npy"
    npy.mkdir()
    for i in range(8):
        np.save(npy / f"{i:03d}.npy", np.ones((1024, 64), np.float32))  # 8 x 256 KB
    with small_filesystem(tmp_path / "small", "1m") as small:
        proc = subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={npy}",
                               f"output={small / 'ds'}"], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert f"jobs.prepare: error: output='{small / 'ds'}': the dataset needs about 2.1 MB " \
               f"(the input's size) and {small} has 1.0 MB free" in proc.stderr
        assert "(free space there, or choose another output)" in proc.stderr
        assert "Traceback" not in proc.stderr and list(small.iterdir()) == []
