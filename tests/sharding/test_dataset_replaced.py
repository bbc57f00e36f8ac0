"""A dataset replaced under its reader (``jobs.prepare overwrite=true`` while a run reads it): the
reader stops with one error naming the path, at the next epoch's start or the next shard it maps.
A run went on reading the new shards under the old samples' numbers and was reported COMPLETED."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.prepare import prepare
from orchestrator.config import PrepareConfig
from sharding import DatasetChangedError, DatasetError, ShardedSampler, lease, make_loader, open_dataset
from sharding.writer import DatasetWriter


def write(path: Path, offset: float, overwrite: bool = False) -> Path:
    """40 samples x float32 [3], in 5 shards: the same shapes whatever ``offset``, other values."""
    with DatasetWriter(path, shard_bytes=8 * 12 + 8, overwrite=overwrite) as writer:
        for i in range(40):
            writer.append({"x": np.full(3, i + offset, np.float32), "y": np.int64(i % 4)})
    return path


def write_pt(path: Path) -> Path:
    torch.save([torch.full((3,), float(i)) for i in range(3)], path)
    return path


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in process", "2 persistent workers"])
def test_a_loader_stops_at_the_next_epoch_when_its_dataset_was_replaced(tmp_path: Path,
                                                                        num_workers: int) -> None:
    path = write(tmp_path / "data", offset=0)
    sampler = ShardedSampler(open_dataset(path).shard_counts, world_size=2, rank=0, seed=0)
    loader = make_loader(path, sampler, batch_size=4, num_workers=num_workers)
    first = [b["x"].clone() for b in loader]
    sampler.set_epoch(1)
    assert len(list(loader)) == len(first)  # an epoch over the same dataset reads on
    write(path, offset=1000, overwrite=True)  # the same shapes and shard counts
    sampler.set_epoch(2)
    with pytest.raises(DatasetChangedError) as stopped:
        iter(loader)
    message = str(stopped.value)
    assert message.startswith(f"{path} was replaced while this run reads it: it was dataset ")
    assert f"is dataset {open_dataset(path).fingerprint} now" in message


def test_a_shard_mapped_after_the_replacement_is_refused_mid_epoch(tmp_path: Path) -> None:
    """A reader keeps few shards mapped (max_open_shards) and maps the next from the path."""
    path = write(tmp_path / "data", offset=0)
    ds = open_dataset(path, max_open_shards=1)
    assert float(ds.sample(0)["x"][0]) == 0.0  # shard 0 mapped
    write(path, offset=1000, overwrite=True)
    assert float(ds.sample(1)["x"][0]) == 1.0  # still the map of the old shard 0: its own bytes
    with pytest.raises(DatasetChangedError, match=rf"^{path} was replaced while this run reads it"):
        ds.sample(39)  # another shard: would be the new dataset's


def test_a_dataset_removed_under_its_reader_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path / "data", offset=0)
    ds = open_dataset(path, max_open_shards=1)
    shutil.rmtree(path)
    with pytest.raises(DatasetChangedError, match=rf"^{path}: its manifest.json is gone"):
        ds.check_unchanged()


def test_a_copy_read_again_is_unchanged(tmp_path: Path) -> None:
    """Only a replacement counts: reading, and opening the dataset again, change nothing."""
    path = write(tmp_path / "data", offset=0)
    ds = open_dataset(path, max_open_shards=1)
    for i in range(40):
        ds.sample(i)
    open_dataset(path)
    ds.check_unchanged()


HOLD_LEASE = """
import sys
from sharding import lease
with lease.hold(sys.argv[1], sys.argv[2]) as held:
    print("held" if held else "none", flush=True)
    sys.stdin.read()  # until the test closes it, or kills this process
"""


def hold_lease(dataset: Path, owner: str) -> subprocess.Popen[str]:
    """A reader in another process (flock is per open file, as across nodes)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, str(dataset), owner], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_an_overwrite_is_refused_while_a_live_run_holds_the_dataset_naming_it(tmp_path: Path) -> None:
    """The run's rank 0 holds a lease (jobs.train does, through sharding.lease) beside the dataset:
    jobs.prepare overwrite=true names that run and changes nothing; once the run is gone (killed:
    its lease file stays, its lock does not), the overwrite goes ahead and removes the stale lease."""
    path = write(tmp_path / "data", offset=0)
    link = tmp_path / "link"
    link.symlink_to(path)
    reader = hold_lease(link, "job 4242 (rank 0, pid 1 on n1), run directory /runs/a")  # through a link
    try:
        with pytest.raises(DatasetError) as refused:
            prepare(PrepareConfig(input=str(write_pt(tmp_path / "raw.pt")), output=str(path), overwrite=True))
        assert str(refused.value) == (
            f"{path} is being read by job 4242 (rank 0, pid 1 on n1), run directory /runs/a: overwrite=true "
            f"would change the data under that run; wait until it ends, or choose another output")
        assert len(open_dataset(path)) == 40  # untouched
        assert lease.live_readers(path) == ["job 4242 (rank 0, pid 1 on n1), run directory /runs/a"]
    finally:
        reader.kill()
        reader.wait()
    assert len(list(lease.readers_dir(path).iterdir())) == 1  # a killed reader leaves its file
    prepare(PrepareConfig(input=str(tmp_path / "raw.pt"), output=str(path), overwrite=True))
    assert len(open_dataset(path)) == 3 and list(lease.readers_dir(path).iterdir()) == []


def test_a_reader_that_ends_removes_its_lease(tmp_path: Path) -> None:
    path = write(tmp_path / "data", offset=0)
    with lease.hold(path, "me") as held:
        assert held and len(list(lease.readers_dir(path).glob("*.lock"))) == 1
    assert not lease.readers_dir(path).exists()


def test_a_run_that_cannot_make_its_lease_reads_without_one(tmp_path: Path) -> None:
    """As in a dataset folder the run may not write: the readers' own check still stops it."""
    path = write(tmp_path / "data", offset=0)
    lease.readers_dir(path).write_text("in the way")
    with lease.hold(path, "me") as held:
        assert not held
    assert lease.live_readers(path) == []
