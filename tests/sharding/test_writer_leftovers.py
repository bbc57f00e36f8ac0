"""What a writer leaves when the process or the disk fails under it: a killed writer's temp
directory is removed by the next writer (a live one's never), and a full disk is one clear error
with nothing published and nothing left behind."""

from __future__ import annotations

import contextlib
import os
import re
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


def test_a_full_disk_reports_the_space_left_when_it_failed_not_after_the_cleanup(tmp_path: Path) -> None:
    """Issue 27: the free space was measured after the partial copy was removed, so a full 2 MB
    file system was reported with '2.0 MB free there'."""
    with small_filesystem(tmp_path / "small", "2m") as small:
        writer = DatasetWriter(small / "ds", shard_bytes=256 * 1024)
        with pytest.raises(DatasetError) as caught:
            for _ in range(1000):
                writer.append({"x": np.ones((256, 64), np.float32)})
            writer.close()
        free = re.search(r", ([\d.]+) ([KMG]?B) free there;", str(caught.value))
        assert free, str(caught.value)
        scale = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[free.group(2)]
        assert float(free.group(1)) * scale < 256 * 1024, \
            f"reported {free.group(1)} {free.group(2)} free on a full 2 MB file system"


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


def written_mb(message: str) -> float:
    return float(message.split(" after ", 1)[1].split(" MB of data", 1)[0])


@pytest.mark.parametrize("shard_bytes", [256 * 1024, 1024 * 1024])
def test_a_full_disk_mid_shard_is_one_error_with_the_bytes_really_written(
        tmp_path: Path, shard_bytes: int) -> None:
    """Before: with 1 MB shards the disk filled inside a shard's buffered data, the abort's close()
    failed flushing it again, and a raw OSError escaped with the temp directory left in place; and
    the bytes written counted the open shard twice (2.8 MB written to a 2 MB file system)."""
    with small_filesystem(tmp_path / "small", "2m") as small:
        out = small / "ds"
        writer = DatasetWriter(out, shard_bytes=shard_bytes)
        with pytest.raises(DatasetError) as caught:
            for _ in range(1000):
                writer.append({"x": np.ones((256, 64), np.float32)})
            writer.close()
        message = str(caught.value)
        assert message.startswith(f"cannot write {out}: No space left on device after ")
        assert 1.0 < written_mb(message) <= 2.1, message  # 2 MB of tmpfs, 2.1e6 bytes
        assert list(small.iterdir()) == []


def megatron_tokens(prefix: Path, num_sequences: int) -> None:
    """One uint8 token per sequence: the input is 1 byte a sample, the dataset 24 (8 of padded data,
    an offset and a length), so the up-front space check passes and the disk fills while writing."""
    from tests.sharding.test_prepare import write_megatron

    write_megatron(prefix, list(np.ones((num_sequences, 1), np.uint8)), np.uint8)


def prepare(input_path: Path, output: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={input_path}",
                           f"output={output}"], capture_output=True, text=True, timeout=300)


def test_prepare_on_a_full_disk_ends_in_one_line_and_publishes_nothing(tmp_path: Path) -> None:
    """Before: an OSError traceback ([Errno 28] without the output path) and, after the writer's
    own message, a second line naming an input sample that had nothing to do with it."""
    megatron_tokens(tmp_path / "tokens", 200_000)  # 200 KB in; its 1.6 MB of data fill 1 MB
    with small_filesystem(tmp_path / "small", "1m") as small:
        proc = prepare(tmp_path / "tokens", small / "ds")
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"jobs.prepare: error: cannot write {small / 'ds'}: No space left on "
                               f"device after "), proc.stderr[-2000:]
        assert last.endswith("; nothing was published and the partial copy was removed (free space "
                             "on that file system, or choose another output)")
        assert "Traceback" not in proc.stderr and "input:" not in proc.stderr
        assert list(small.iterdir()) == []


def test_prepare_to_a_read_only_file_system_ends_in_one_line(tmp_path: Path) -> None:
    """Before: a raw OSError traceback ([Errno 30]) naming only the writer's temp directory."""
    megatron_tokens(tmp_path / "tokens", 100)
    with small_filesystem(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        proc = prepare(tmp_path / "tokens", ro / "sub" / "ds")
        assert proc.returncode == 1
        assert proc.stderr.strip() == (
            f"jobs.prepare: error: cannot write {ro / 'sub' / 'ds'}: Read-only file system before "
            f"any data was written, 1.0 MB free there; nothing was published (that file system is "
            f"read-only: choose another output)")


def test_a_quota_is_named_as_one(tmp_path: Path) -> None:
    """EDQUOT cannot happen to root (quotas exempt it), so its message is checked directly."""
    import errno

    from sharding.writer import _io_message

    message = _io_message(tmp_path / "ds", OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), 3_000_000)
    assert message.startswith(f"cannot write {tmp_path / 'ds'}: Disk quota exceeded after 3.0 MB of data, ")
    assert message.endswith("(your quota there is used up: free some, or choose another output)")


def test_the_published_dataset_holds_no_lock_file(tmp_path: Path) -> None:
    with DatasetWriter(tmp_path / "ds") as writer:
        [tmp] = leftovers(tmp_path / "ds")
        assert (tmp / ".lock").is_file()  # a regular file, lockable where NFS emulates flock
        writer.append({"x": np.ones((2, 4), np.float32)})
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == [
        "manifest.json", "shard-00000.bin", "shard-00000.idx"]


def test_a_file_system_without_flock_still_writes_and_keeps_what_it_cannot_judge(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT INJECTION, not a real file system: Lustre mounted without -o flock answers flock with
    ENOSYS, and no file system here does. Before: that OSError escaped DatasetWriter() raw, so
    prepare could not write to such a file system at all."""
    import errno
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "ds"
    first = DatasetWriter(out)  # as if killed: nobody can tell that it is dead
    first.append({"x": np.ones((2, 4), np.float32)})
    [kept] = leftovers(out)
    with DatasetWriter(out) as writer:
        writer.append({"x": np.ones((1, 4), np.float32)})
    assert kept.exists() and len(open_dataset(out)) == 1
    first.abort()
