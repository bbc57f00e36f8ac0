"""Sharded, memory-mapped datasets: write once, read zero-copy from every rank.

The public API is small::

    from sharding import DatasetWriter, open_dataset, collate_padded

    with DatasetWriter("data/train", shard_bytes=256 * 2**20) as writer:
        writer.append({"x": np.zeros((rows, 64), np.float32), "y": np.int64(label)})

    ds = open_dataset("data/train")      # checks magic, version and sizes; maps nothing yet
    len(ds), ds.schema, ds.shard_counts, ds.fingerprint
    ds.sample(i)                         # {"x": ndarray view, "y": 0-d view}, zero-copy
    ds[i]                                # the same as torch tensors, still zero-copy

Training reads through the sampler and the batched loader::

    from sharding import ShardedSampler, make_loader

    sampler = ShardedSampler(ds.shard_counts, world_size=W, rank=r, seed=0)
    for batch in make_loader(ds, sampler, batch_size=64):   # padded tensors, index, is_pad
        ...

Importing this package does not import torch; ``ds[i]``, ``collate_padded`` and the first use of
a sampler or loader name (``ShardedSampler``, ``make_loader``, ...) do.
The on-disk layout is documented byte by byte in docs/format.md.
"""

from typing import TYPE_CHECKING, Any

from sharding.collate import collate_padded, length_grouped_batches, padding_fraction
from sharding.format import (
    CorruptDatasetError,
    DatasetChangedError,
    DatasetError,
    FieldSpec,
    SchemaMismatchError,
)
from sharding.partition import (
    Partition,
    PartitionError,
    Policy,
    Segment,
    partition,
    remaining_partition,
)
from sharding.reader import ShardedDataset, open_dataset
from sharding.verify import Problem, run_verify_cli, verify
from sharding.writer import DatasetWriter

if TYPE_CHECKING:
    from sharding.loader import (
        Batch,
        BufferPool,
        LengthGroupedBatchSampler,
        RankDataset,
        make_loader,
        pass_batch,
    )
    from sharding.sampler import SamplerStateError, ShardedSampler, decode, decode_array

# Names whose modules import torch: loaded on first access (PEP 562), so `import sharding` and
# the torch-free tools built on it (`switchyard verify`, jobs.prepare) stay light.
_LAZY = {
    "SamplerStateError": "sharding.sampler",
    "ShardedSampler": "sharding.sampler",
    "decode": "sharding.sampler",
    "decode_array": "sharding.sampler",
    "Batch": "sharding.loader",
    "BufferPool": "sharding.loader",
    "LengthGroupedBatchSampler": "sharding.loader",
    "RankDataset": "sharding.loader",
    "make_loader": "sharding.loader",
    "pass_batch": "sharding.loader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'sharding' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Batch",
    "BufferPool",
    "CorruptDatasetError",
    "DatasetChangedError",
    "DatasetError",
    "DatasetWriter",
    "FieldSpec",
    "LengthGroupedBatchSampler",
    "Partition",
    "PartitionError",
    "Policy",
    "Problem",
    "RankDataset",
    "SamplerStateError",
    "SchemaMismatchError",
    "Segment",
    "ShardedDataset",
    "ShardedSampler",
    "collate_padded",
    "decode",
    "decode_array",
    "length_grouped_batches",
    "make_loader",
    "open_dataset",
    "padding_fraction",
    "partition",
    "pass_batch",
    "remaining_partition",
    "run_verify_cli",
    "verify",
]
