"""The Lightning recipe (docs/recipes/lightning_ddp.py) as the tests run it: its data, the
`switchyard run` command, and what each rank recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from sharding import DatasetWriter

RECIPE = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "lightning_ddp.py"
TRAIN_SAMPLES, EVAL_SAMPLES = 96, 31  # 31: padding on 2 and on 4 ranks, so the counting is tested


def write_data(root: Path) -> tuple[Path, Path]:
    """Variable-row 2-D samples: x float32 [rows 1..19, 8], y int64 in 0..3; several shards."""
    rng = np.random.default_rng(0)
    paths = []
    for name, num in (("train", TRAIN_SAMPLES), ("eval", EVAL_SAMPLES)):
        with DatasetWriter(root / name, shard_bytes=2048) as writer:
            for i in range(num):
                rows = int(rng.integers(1, 20))
                writer.append({"x": rng.standard_normal((rows, 8)).astype(np.float32), "y": np.int64(i % 4)})
        paths.append(root / name)
    return paths[0], paths[1]


def recipe_command(train: Path, eval_: Path, record: Path, *extra: str) -> list[str]:
    return [sys.executable, str(RECIPE), "--train", str(train), "--eval", str(eval_),
            "--record", str(record), *extra]


def seen(record: Path, rank: int) -> list[tuple[int, list[int]]]:
    """(epoch, real sample ids) of each training batch rank `rank` ran, over all attempts."""
    lines = (record / f"seen-rank{rank}.jsonl").read_text().splitlines()
    return [(row["epoch"], row["index"]) for row in map(json.loads, lines)]


def eval_counts(record: Path, rank: int) -> list[float]:
    lines = (record / f"val-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["val_samples"] for line in lines]


def uninterrupted(train: Path, world: int, epochs: int, batch_size: int = 4
                  ) -> list[list[tuple[int, list[int]]]]:
    """What each rank of an uninterrupted run of the recipe trains on, in `seen`'s form, for ranks
    0..world-1: the recipe's own ShardedDataModule, set up as a Trainer of `world` ranks sets it up,
    its training loader taken at each epoch's start and each batch counted as its callback counts
    it. The tests compare a signalled, resumed run with this instead of training a whole second run
    of the recipe (about 5 s of CPU per rank, most of it importing Lightning); when both ran, both
    gave these batches."""
    from types import SimpleNamespace

    from sharding.lightning import ShardedDataModule

    ranks = []
    for rank in range(world):
        trainer = SimpleNamespace(world_size=world, global_rank=rank, current_epoch=0, callbacks=[],
                                  _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))
        module = ShardedDataModule(train=train, batch_size=batch_size)
        module.trainer = trainer
        module.setup("fit")
        [advance] = trainer.callbacks  # the callback setup adds: it counts each batch at its start
        batches = []
        for epoch in range(epochs):
            trainer.current_epoch = epoch
            for batch in module.train_dataloader():
                advance.on_train_batch_start(trainer, None, batch, len(batches))
                batches.append((epoch, batch["index"][~batch["is_pad"]].tolist()))
        module.teardown("fit")  # as a Trainer ends a fit: rank 0's dataset leases are released
        ranks.append(batches)
    return ranks
