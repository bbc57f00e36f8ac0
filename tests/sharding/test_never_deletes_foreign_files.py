"""Every place that deletes files, against a directory holding a file that is not its own: the
dataset overwrite and the stale-temp cleanup of the writer (the checkpoint leftover cleanup is in
tests/orchestrator/training/test_checkpoint_leftovers.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.prepare import prepare
from orchestrator.config import ConfigError, PrepareConfig
from sharding import DatasetError, DatasetWriter, open_dataset, verify
from sharding.writer import remove_stale_siblings


def _raw(path: Path, n: int = 6) -> Path:
    torch.save([torch.full((2, 3), float(i)) for i in range(n)], path)
    return path


def _prepare(input_path: Path, output: Path, overwrite: bool = False) -> None:
    prepare(PrepareConfig(input=str(input_path), output=str(output), overwrite=overwrite))


def test_overwrite_refuses_a_dataset_directory_holding_the_users_files(tmp_path: Path) -> None:
    """Before: the issue's commands deleted raw.pt and notes.txt from D."""
    dataset = tmp_path / "D"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    (dataset / "notes.txt").write_text("mine")
    _raw(dataset / "raw.pt")
    with pytest.raises(DatasetError, match=r"holds files that are not part of its dataset: "
                                           r"'notes.txt', 'raw.pt'.*move them out"):
        _prepare(tmp_path / "raw.pt", dataset, overwrite=True)
    assert (dataset / "notes.txt").read_text() == "mine" and (dataset / "raw.pt").is_file()
    assert len(open_dataset(dataset)) == 6  # the old dataset is untouched too


def test_overwrite_still_replaces_a_dataset_that_holds_only_its_own_files(tmp_path: Path) -> None:
    dataset = tmp_path / "D"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    _prepare(_raw(tmp_path / "raw4.pt", n=4), dataset, overwrite=True)
    assert len(open_dataset(dataset)) == 4


@pytest.mark.parametrize("through", ["prepare", "writer"])
def test_overwrite_through_a_symlink_replaces_the_dataset_it_names_and_leaves_nothing(
        tmp_path: Path, through: str) -> None:
    """``output=LINK overwrite=true``: the publish renamed onto the link itself and failed with "Is a
    directory after 0.0 MB of data", leaving an empty ``.LINK.old-*`` directory behind."""
    (tmp_path / "store").mkdir()
    dataset, link = tmp_path / "store" / "D", tmp_path / "link"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    link.symlink_to(dataset)
    if through == "prepare":
        _prepare(_raw(tmp_path / "raw4.pt", n=4), link, overwrite=True)
    else:
        with DatasetWriter(link, overwrite=True) as writer:
            for i in range(4):
                writer.append({"x": np.full((2, 3), float(i), np.float32)})
    assert link.is_symlink() and link.resolve() == dataset  # the link stays, naming the new dataset
    assert len(open_dataset(link)) == 4 and verify(dataset) == []
    leftovers = [p for folder in (tmp_path, tmp_path / "store") for p in folder.iterdir() if p.name[0] == "."]
    assert leftovers == []  # no .link.old-*, no .D.old-*, no temp directory


def test_a_subdirectory_is_not_the_datasets_either(tmp_path: Path) -> None:
    dataset = tmp_path / "D"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    (dataset / "shard-00099.bin").mkdir()  # named like a shard file, but a directory
    with pytest.raises(DatasetError, match=r"'shard-00099.bin'"):
        _prepare(tmp_path / "raw.pt", dataset, overwrite=True)


def test_an_input_inside_the_output_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    dataset = tmp_path / "D"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    (tmp_path / "raw.pt").rename(dataset / "raw.pt")
    with pytest.raises(ConfigError, match=r"input=.*raw.pt' is inside output=.*would delete its own "
                                          r"input"):
        _prepare(dataset / "raw.pt", dataset, overwrite=True)
    assert (dataset / "raw.pt").is_file()
    fresh = tmp_path / "new"
    fresh.mkdir()
    _raw(fresh / "raw.pt")  # an input inside a new output's directory: same refusal
    with pytest.raises(ConfigError, match="inside output"):
        _prepare(fresh / "raw.pt", fresh, overwrite=True)


def test_verify_names_a_file_that_is_not_part_of_the_dataset(tmp_path: Path) -> None:
    dataset = tmp_path / "D"
    _prepare(_raw(tmp_path / "raw.pt"), dataset)
    assert verify(dataset) == []
    (dataset / "notes.txt").write_text("mine")
    [problem] = verify(dataset)
    assert problem.file == str(dataset / "notes.txt") and "not part of the dataset" in problem.what


SLOW_WRITER = """
import sys, time, numpy as np
from sharding import DatasetWriter
with DatasetWriter(sys.argv[1]) as w:
    while True:
        w.append({"x": np.zeros((256, 64), np.float32)})
        time.sleep(0.001)
"""


def test_a_killed_writer_of_another_output_leaves_nothing_for_long(tmp_path: Path) -> None:
    """Before: a prepare killed while writing output=a left .a.tmp-* for good, since the next
    writer (of output=b) only looked for .b.tmp-*. A live writer's temp, and a look-alike without
    a lock, stay."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(tmp_path / "a")])
    try:
        deadline = time.monotonic() + 60
        while not any(p.is_dir() and any(p.iterdir()) for p in tmp_path.glob(".a.tmp-*")):
            assert time.monotonic() < deadline and proc.poll() is None, "the writer never wrote"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    [stale] = tmp_path.glob(".a.tmp-*")
    lookalike = tmp_path / ".mine.tmp-keep"
    lookalike.mkdir()
    (lookalike / "data").write_text("not a writer's")
    (lookalike / ".lock").write_text("")  # an unlocked .lock of its own: still not a writer's name
    live = DatasetWriter(tmp_path / "c")
    live.append({"x": np.ones((1, 4), np.float32)})
    try:
        with DatasetWriter(tmp_path / "b") as writer:
            writer.append({"x": np.ones((2, 4), np.float32)})
        assert not stale.exists()
        assert (lookalike / "data").is_file()
        assert remove_stale_siblings(tmp_path / "b") == []  # c's writer is alive
    finally:
        live.close()
    assert len(open_dataset(tmp_path / "c")) == 1
