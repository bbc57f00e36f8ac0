"""The batched loader feeding a GPU: worker ring batches through pin_memory, then to cuda:0.

Skipped where no NVIDIA GPU is visible; run with ``pytest -m gpu tests/gpu`` on a GPU node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from batch_helpers import assert_batches_equal, varied_samples

from sharding import ShardedSampler, make_loader, open_dataset
from sharding.writer import DatasetWriter

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and driver"),
]


def test_pinned_worker_batches_reach_the_gpu_intact(tmp_path: Path) -> None:
    path = tmp_path / "ds"
    with DatasetWriter(path, shard_bytes=8192) as writer:
        for sample in varied_samples(400, seed=5):
            writer.append(sample)
    ds = open_dataset(path)

    def loader(**kwargs: object) -> object:
        return make_loader(ds, ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=1), 16, **kwargs)

    expected = [{k: v.clone() for k, v in b.items()} for b in loader()]
    iterator = iter(loader(num_workers=2, pin_memory=True))
    for want in expected:
        batch = next(iterator)
        assert all(t.is_pinned() for t in batch.values())  # the pin thread copied the ring slot
        on_gpu = {k: v.to("cuda:0", non_blocking=True) for k, v in batch.items()}
        torch.cuda.synchronize()
        assert_batches_equal({k: v.cpu() for k, v in on_gpu.items()}, want)
