"""Zero-copy views, lazy per-process opening, pickling, and real DataLoader workers (fork)."""

from __future__ import annotations

import mmap
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from sharding import collate_padded, open_dataset
from sharding.reader import ShardedDataset


def _mapped_files(root: Path) -> set[str]:
    """Files under ``root`` that this process has memory-mapped, from the kernel's own list."""
    with open("/proc/self/maps") as f:
        return {Path(line.split()[-1]).name for line in f if str(root) in line}


def _shard_of(ds: ShardedDataset, i: int) -> int:
    return int(ds.locate(np.array([i]))[0][0])


def test_sample_views_are_the_memory_map(dataset_path):
    ds = open_dataset(dataset_path)
    i = next(k for k in range(len(ds)) if len(ds.sample(k)["x"]))
    view = ds.sample(i)["x"]
    assert isinstance(view.base, mmap.mmap)  # a view of the map itself, not a copy
    whole_file = np.frombuffer(view.base, np.uint8)
    assert np.shares_memory(view, whole_file)
    tensor = ds[i]["x"]
    assert np.shares_memory(tensor.numpy(), whole_file)  # torch.from_numpy: still no copy


def test_bytes_written_to_the_file_show_up_in_an_earlier_view(dataset_path):
    """Proof of zero-copy from outside Python: the view reads the page cache directly."""
    ds = open_dataset(dataset_path)
    i = next(k for k in range(len(ds)) if len(ds.sample(k)["x"]))
    view = ds.sample(i)["x"]
    shard = _shard_of(ds, i)
    offset = view.ctypes.data - np.frombuffer(view.base, np.uint8).ctypes.data
    data_file = dataset_path / ds.manifest.shards[shard].data_file
    with open(data_file, "r+b") as f:
        f.seek(offset)
        f.write(np.float32(1234.5).tobytes())
    assert view[0, 0] == np.float32(1234.5)


def test_tensors_from_the_map_raise_no_warning(dataset_path):
    ds = open_dataset(dataset_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable arrays: must not happen
        item = ds[0]
    assert isinstance(item["x"], torch.Tensor)


def test_open_maps_nothing_and_a_read_maps_only_its_shard(dataset_path):
    ds = open_dataset(dataset_path)
    assert len(ds.shard_counts) > 4
    assert ds.open_shards == () and _mapped_files(dataset_path) == set()
    i = sum(ds.shard_counts[:3]) + 1  # a sample of shard 3
    ds.sample(i)
    assert ds.open_shards == (3,)
    info = ds.manifest.shards[3]
    assert _mapped_files(dataset_path) == {info.data_file, info.index_file}
    ds.close()


def test_at_most_max_open_shards_stay_mapped(dataset_path):
    ds = open_dataset(dataset_path, max_open_shards=2)
    starts = np.concatenate([[0], np.cumsum(ds.shard_counts)[:-1]])
    views = [ds.sample(int(s))["y"] for s in starts[:4]]
    assert ds.open_shards == (2, 3)  # oldest maps dropped first
    assert [int(v) for v in views] == [int(ds.sample(int(s))["y"]) for s in starts[:4]]


def test_pickle_is_small_and_carries_no_map(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    ds.sample(0)
    ds.leading_sizes("x")
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    clone = pickle.loads(blob)
    assert clone.open_shards == () and clone.fingerprint == ds.fingerprint
    np.testing.assert_array_equal(clone.sample(59)["x"], mixed_samples[59]["x"])


def _expect_fresh_worker(_: int) -> None:
    ds = get_worker_info().dataset
    if ds.open_shards != ():  # raised in the worker, re-raised by DataLoader in the parent
        raise RuntimeError(f"worker {os.getpid()} inherited maps of shards {ds.open_shards}")


def _fork_loader(ds: ShardedDataset, **kwargs: object) -> DataLoader:
    return DataLoader(ds, num_workers=2, multiprocessing_context="fork",
                      worker_init_fn=_expect_fresh_worker, **kwargs)  # type: ignore[arg-type]


def test_dataloader_fork_workers_reopen_lazily(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    ds.sample(0)  # the parent maps shard 0 before forking
    assert ds.open_shards == (0,)
    loader = _fork_loader(ds, batch_size=None, shuffle=False)
    got = list(loader)
    assert len(got) == len(mixed_samples)
    for item, expected in zip(got, mixed_samples, strict=True):
        np.testing.assert_array_equal(item["x"].numpy(), expected["x"])
        assert int(item["y"]) == int(expected["y"])
    assert ds.open_shards == (0,)  # the parent's own map is untouched


def test_dataloader_with_padded_collate(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    loader = _fork_loader(ds, batch_size=8, collate_fn=collate_padded)
    batches = list(loader)
    assert len(batches) == 8  # 60 samples
    first = batches[0]
    np.testing.assert_array_equal(first["x_lengths"].numpy(),
                                  [len(s["x"]) for s in mixed_samples[:8]])
    for row, sample in enumerate(mixed_samples[:8]):
        n = len(sample["x"])
        np.testing.assert_array_equal(first["x"][row, :n].numpy(), sample["x"])
        assert bool(first["x_mask"][row, :n].all()) and not bool(first["x_mask"][row, n:].any())


@pytest.mark.parametrize("start_method", ["spawn"])
def test_dataloader_spawn_workers_unpickle_cheaply(dataset_path, mixed_samples, start_method):
    ds = open_dataset(dataset_path)
    ds.sample(0)
    loader = DataLoader(ds, num_workers=1, batch_size=None, multiprocessing_context=start_method)
    got = [int(item["y"]) for item in loader]
    assert got == [int(s["y"]) for s in mixed_samples]
