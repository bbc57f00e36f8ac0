"""Batch memory: layouts, and worker rings whose slots are reused only once a batch is dropped."""

from __future__ import annotations

import gc
import mmap
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from batch_helpers import assert_batches_equal, varied_samples
from hypothesis import given
from hypothesis import strategies as st
from train_helpers import train_command

from sharding import DatasetError, RankDataset, ShardedSampler, make_loader, open_dataset
from sharding.batch_memory import (
    HUGE_PAGE,
    BatchRing,
    RingBatch,
    batch_layout,
    huge_page_buffer,
    numpy_views,
    tensor_views,
)
from sharding.writer import DatasetWriter


@pytest.fixture(scope="module")
def many_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 samples: enough batches of 8 for every slot of every ring to be used many times."""
    path = tmp_path_factory.mktemp("ring") / "many"
    with DatasetWriter(path, shard_bytes=8192) as writer:
        for sample in varied_samples(600, seed=3):
            writer.append(sample)
    return path


def loader_for(path: Path, **kwargs: Any) -> Any:
    ds = open_dataset(path)
    sampler = ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=2)
    return make_loader(ds, sampler, 8, **kwargs), sampler


def expected_batches(path: Path) -> list[dict[str, torch.Tensor]]:
    loader, _ = loader_for(path)
    return [{k: v.clone() for k, v in batch.items()} for batch in loader]


def ring_ranges(iterator: Any) -> list[tuple[int, int]]:
    return [(r.array().ctypes.data, r.array().ctypes.data + r.array().nbytes)
            for r in iterator._switchyard_rings]


def in_a_ring(batch: dict[str, torch.Tensor], ranges: list[tuple[int, int]]) -> bool:
    pointers = [t.data_ptr() for t in batch.values()]
    return any(all(lo <= p < hi for p in pointers) for lo, hi in ranges)


def consume_one_at_a_time(iterator: Iterator[dict[str, torch.Tensor]],
                          expected: list[dict[str, torch.Tensor]], ranges: list[tuple[int, int]]) -> set[int]:
    """Check each batch as it arrives, then drop it, as a training loop does; -> slot addresses."""
    addresses = set()
    for want in expected:
        batch = next(iterator)
        assert_batches_equal(batch, want)
        assert in_a_ring(batch, ranges)
        addresses.add(batch["x"].data_ptr())
        del batch  # released: its slot goes back to its worker
    with pytest.raises(StopIteration):
        next(iterator)
    return addresses


@pytest.mark.parametrize("context", [None, "spawn"])
def test_dropped_batches_come_back_as_slots_with_the_right_contents(many_path: Path,
                                                                    context: str | None) -> None:
    expected = expected_batches(many_path)
    assert len(expected) == 75
    loader, _ = loader_for(many_path, num_workers=2, multiprocessing_context=context)
    iterator = iter(loader)
    addresses = consume_one_at_a_time(iterator, expected, ring_ranges(iterator))
    assert len(addresses) <= 2 * 4  # 75 batches in the 4 slots of each of the 2 rings


def test_kept_batches_are_never_overwritten(many_path: Path) -> None:
    expected = expected_batches(many_path)
    loader, _ = loader_for(many_path, num_workers=2)
    iterator = iter(loader)
    ranges = ring_ranges(iterator)
    kept = list(iterator)  # nothing released: the rings fill, then workers take fresh memory
    for got, want in zip(kept, expected, strict=True):
        assert_batches_equal(got, want)
    from_rings = sum(in_a_ring(batch, ranges) for batch in kept)
    assert from_rings == 8  # every slot once, the other 67 batches in fresh shared memory
    assert all(t.is_shared() for batch in kept if not in_a_ring(batch, ranges) for t in batch.values())


def test_persistent_workers_keep_their_rings_across_epochs(many_path: Path) -> None:
    loader, sampler = loader_for(many_path, num_workers=2, persistent_workers=True)
    first = iter(loader)
    ranges = ring_ranges(first)
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        reference, _ = loader_for(many_path)
        reference.batch_sampler.sampler.set_epoch(epoch)
        expected = [{k: v.clone() for k, v in batch.items()} for batch in reference]
        iterator = iter(loader)
        assert iterator is first  # the same workers, the same rings
        consume_one_at_a_time(iterator, expected, ranges)


def test_a_batch_outliving_its_workers_is_released_quietly(many_path: Path) -> None:
    loader, _ = loader_for(many_path, num_workers=1)
    iterator = iter(loader)
    kept = next(iterator)
    want = kept["x"].clone()
    iterator._shutdown_workers()
    del iterator, loader
    gc.collect()
    assert torch.equal(kept["x"], want)  # the main process's map outlives the worker
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del kept  # the release finds no reader: ignored, not an error
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not unraisable


def test_ring_slots_zero_and_bad_values(many_path: Path) -> None:
    loader, _ = loader_for(many_path, num_workers=1, ring_slots=0)
    iterator = iter(loader)
    assert not hasattr(iterator, "_switchyard_rings")
    assert next(iterator)["x"].is_shared()  # the plain path: fresh shared memory
    with pytest.raises(ValueError, match=r"ring_slots=-1 .*>= 0"):
        loader_for(many_path, num_workers=1, ring_slots=-1)


# ------------------------------------------------------------------------------------------------
# The ring and the layout on their own


def test_claim_release_in_one_process() -> None:
    ring = BatchRing(slot_bytes=100, num_slots=2)
    assert ring.slot_bytes == mmap.PAGESIZE  # slots start on a page
    layout = batch_layout([("a", np.dtype(np.int64), (3,))])
    first, second = ring.claim(layout.nbytes), ring.claim(layout.nbytes)
    assert (first, second) == (0, 1) and ring.claim(layout.nbytes) is None
    assert ring.claim(mmap.PAGESIZE + 1) is None  # never a batch bigger than a slot
    arrays = numpy_views(ring.slot(first, layout.nbytes), layout)
    arrays["a"][:] = [1, 2, 3]
    received = pickle.loads(pickle.dumps(ring.batch(first, layout, arrays)))  # as the main process
    assert type(received) is dict and received["a"].tolist() == [1, 2, 3]
    view = received["a"][1:]
    del received
    assert ring.claim(layout.nbytes) is None  # a view still uses the slot
    del view
    assert ring.claim(layout.nbytes) == first


def test_a_batch_from_an_unknown_ring_is_a_clear_error() -> None:
    layout = batch_layout([("a", np.dtype(np.int64), (1,))])
    batch = RingBatch({"a": torch.zeros(1, dtype=torch.int64)}, ("no-such-ring", 0, layout))
    with pytest.raises(DatasetError, match="ring no-such-ring, which this process does not have"):
        pickle.loads(pickle.dumps(batch))


dtypes = st.sampled_from([np.dtype(t) for t in ("bool", "uint8", "int16", "float32", "int64", "complex128")])
specs = st.lists(st.tuples(dtypes, st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6)


@given(specs)
def test_layout_parts_are_aligned_disjoint_and_bounded_by_bigger_shapes(spec: list[Any]) -> None:
    layout = batch_layout([(f"k{n}", dtype, tuple(shape)) for n, (dtype, shape) in enumerate(spec)])
    ends = 0
    for part, (dtype, shape) in zip(layout.parts, spec, strict=True):
        assert part.offset % 64 == 0 and part.offset >= ends
        ends = part.offset + int(np.prod(shape)) * dtype.itemsize
    assert layout.nbytes == ends
    bigger = batch_layout([(f"k{n}", d, tuple(s + 1 for s in shape)) for n, (d, shape) in enumerate(spec)])
    assert bigger.nbytes >= layout.nbytes
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    tensors, arrays = tensor_views(block, layout), numpy_views(block.numpy(), layout)
    for key, array in arrays.items():
        array[...] = 1  # written through numpy, seen through torch: the same bytes
        assert tensors[key].shape == array.shape and tensors[key].numpy().dtype == array.dtype
        assert torch.equal(tensors[key], torch.ones_like(tensors[key]))


def test_rank_dataset_batch_bytes_bound_every_batch(many_path: Path) -> None:
    rank_ds = RankDataset(many_path)
    bound = rank_ds.batch_bytes(8)
    lengths = open_dataset(many_path).leading_sizes("x")
    longest = np.argsort(lengths)[-8:].tolist()
    batch = rank_ds.__getitems__(longest)
    used = max(t.data_ptr() + t.nbytes for t in batch.values()) - min(t.data_ptr() for t in batch.values())
    assert used <= bound


@pytest.mark.parametrize("num_bytes", [1, 100, 4096 + 3, HUGE_PAGE, 3 * HUGE_PAGE + 5])
def test_batch_buffers_are_aligned_for_whole_cache_lines(num_bytes: int) -> None:
    """Rows start on cache lines (np.empty's data starts 16 bytes into a page); large buffers
    start on a 2 MiB boundary, so the kernel can back them with huge pages."""
    buffer = huge_page_buffer(num_bytes)
    assert buffer.nbytes == num_bytes and buffer.dtype == np.uint8 and buffer.flags.writeable
    assert buffer.ctypes.data % (HUGE_PAGE if num_bytes >= HUGE_PAGE else 64) == 0
    buffer[:] = 7  # all of it is usable memory
    assert int(buffer[-1]) == 7


# ------------------------------------------------------------------------------------------------
# Shared memory that does not fit: refused before allocating, and nothing left in /dev/shm


def test_ring_bytes_is_what_the_rings_allocate(tmp_path: Path) -> None:
    from sharding import DatasetWriter, open_dataset
    from sharding.loader import RankDataset, make_loader, ring_bytes
    from sharding.sampler import ShardedSampler

    with DatasetWriter(tmp_path / "ds") as writer:
        for i in range(40):
            writer.append({"x": np.ones((1 + i % 7, 32), np.float32), "y": np.int64(i)})
    ds = open_dataset(tmp_path / "ds")
    loader = make_loader(ds, ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=0),
                         batch_size=8, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    allocated = sum(ring.storage.nbytes() for ring in iterator._switchyard_rings)  # type: ignore[attr-defined]
    assert allocated == ring_bytes(RankDataset(ds), 8, 2) > 0
    del iterator


SMALL_SHM = """
import os, sys, numpy as np
from sharding import DatasetWriter, open_dataset
from sharding.batch_memory import SharedMemoryError, new_shared_storage
from sharding.loader import make_loader
from sharding.sampler import ShardedSampler
with DatasetWriter(sys.argv[1]) as w:  # one long sample: the largest batch is 64 x 4000 rows
    for i in range(64):
        w.append({"x": np.ones((1 + (i == 0) * 4000, 256), np.float32), "y": np.int64(1)})
ds = open_dataset(sys.argv[1])
loader = make_loader(ds, ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=0),
                     batch_size=64, num_workers=2)
try:
    iter(loader)
except SharedMemoryError as e:
    print("loader:", e)
try:  # torch itself, past the loader's check: its ENOSPC must not leave its file behind
    new_shared_storage(200 * 2**20)
except SharedMemoryError as e:
    print("storage:", e)
print("left:", sorted(os.listdir("/dev/shm")))
"""


def run_with_small_shm(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a private mount namespace whose /dev/shm is a 64 MB tmpfs (root, as in CI)."""
    import os

    script = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} \"$@\""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *(["-c", code] if code else []),
                           *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot give the test a small /dev/shm: {proc.stderr}")
        pytest.skip(f"cannot give the test a small /dev/shm (not root?): {proc.stderr}")
    return proc


def test_rings_larger_than_shared_memory_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    """Before: torch's ENOSPC deep in the DataLoader, and a GB-sized torch_* file left in /dev/shm
    for good (1.26 TB sparse files in the report)."""
    proc = run_with_small_shm(SMALL_SHM, str(tmp_path / "ds"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("loader: data.batch_size=64 with data.num_workers=2 needs 2,100 MB of "
                               "shared memory for worker batches")
    assert "lower data.batch_size or data.num_workers, set data.num_workers=0" in lines[0]
    assert lines[1].startswith("storage: cannot allocate 210 MB of shared memory in /dev/shm")
    assert lines[2] == "left: []"


def test_the_training_job_refuses_them_before_submitting(tmp_path: Path) -> None:
    command = train_command("data.num_workers=2", "data.batch_size=4096", "data.demo_num_samples=512",
                            cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")
    proc = run_with_small_shm("", *command[1:])  # its own interpreter, in the namespace with a small /dev/shm
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: data.batch_size=4096 with data.num_workers=2 needs ")
    assert "(2 rank(s) x " in proc.stderr and not (tmp_path / "run" / "submitit").exists()
