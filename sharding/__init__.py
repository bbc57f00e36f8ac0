"""Sharded, memory-mapped datasets: write once, read zero-copy from every rank.

The public API is small::

    from sharding import DatasetWriter, open_dataset, collate_padded

    with DatasetWriter("data/train", shard_bytes=256 * 2**20) as writer:
        writer.append({"x": np.zeros((rows, 64), np.float32), "y": np.int64(label)})

    ds = open_dataset("data/train")      # checks magic, version and sizes; maps nothing yet
    len(ds), ds.schema, ds.shard_counts, ds.fingerprint
    ds.sample(i)                         # {"x": ndarray view, "y": 0-d view}, zero-copy
    ds[i]                                # the same as torch tensors, still zero-copy

Importing this package does not import torch; ``ds[i]`` and ``collate_padded`` do, on first use.
The on-disk layout is documented byte by byte in docs/format.md.
"""

from sharding.collate import collate_padded, length_grouped_batches, padding_fraction
from sharding.format import (
    CorruptDatasetError,
    DatasetError,
    FieldSpec,
    SchemaMismatchError,
)
from sharding.reader import ShardedDataset, open_dataset
from sharding.verify import Problem, run_verify_cli, verify
from sharding.writer import DatasetWriter

__all__ = [
    "CorruptDatasetError",
    "DatasetError",
    "DatasetWriter",
    "FieldSpec",
    "Problem",
    "SchemaMismatchError",
    "ShardedDataset",
    "collate_padded",
    "length_grouped_batches",
    "open_dataset",
    "padding_fraction",
    "run_verify_cli",
    "verify",
]
