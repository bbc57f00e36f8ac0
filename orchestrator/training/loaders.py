"""This rank's view of the data: the datasets, the task's view of each, the training sampler and
loader, the eval loader, and the endless stream of batches on the rank's device.

Every rank gets the same number of batches per epoch (the sampler's ``policy``); evaluation visits
every entry once in order (``pad`` policy, no shuffle), padding entries counted in nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from orchestrator.config import TrainConfig
from orchestrator.training import preemption, runtime
from orchestrator.training.device_batches import to_device
from orchestrator.training.runtime import Runtime
from orchestrator.training.tasks import Batch, Task
from sharding import ShardedDataset, open_dataset
from sharding.loader import make_loader
from sharding.partition import Policy
from sharding.sampler import ShardedSampler
from sharding.windows import window_loader


class RankData:
    def __init__(self, cfg: TrainConfig, rt: Runtime, task: Task, train: str, eval_path: str | None) -> None:
        self.cfg, self.rt, self.task = cfg, rt, task
        self.train_ds: ShardedDataset = open_dataset(train)
        self.eval_ds = open_dataset(eval_path) if eval_path else None
        self.eval_path = eval_path
        self.sources: dict[Path, Any] = {}  # dataset root -> the task's view of it (``source``)

    def open_train(self) -> None:
        """The training sampler and loader (once the task has seen the data: ``Task.setup``)."""
        self.sampler, self.loader = self.make_loader(self.train_ds, train=True)

    def make_loader(self, ds: ShardedDataset, train: bool) -> tuple[ShardedSampler, Any]:
        """This rank's sampler and loader over ``ds``: the padded batches of its samples, or what
        the task reads instead (a language model's token windows)."""
        cfg, env = self.cfg, self.rt.env
        source = self.source(ds)
        counts = ds.shard_counts if source is None else source.shard_counts
        sampler = ShardedSampler(counts, world_size=env.world_size, rank=env.rank, seed=cfg.seed,
                                 policy=cast(Policy, cfg.data.policy) if train else "pad", shuffle=train)
        workers, pin = cfg.data.num_workers, self.rt.device.type == "cuda"
        if source is not None:
            return sampler, window_loader(source, sampler, cfg.data.batch_size, num_workers=workers,
                                          pin_memory=pin, worker_ignores=preemption.STOP_SIGNALS)
        return sampler, make_loader(ds, sampler, batch_size=cfg.data.batch_size, num_workers=workers,
                                    pin_memory=pin, group_by_length=cfg.data.group_by_length and train,
                                    worker_ignores=preemption.STOP_SIGNALS)

    def source(self, ds: ShardedDataset) -> Any:
        """The task's own view of ``ds`` (a language model's windows), built once per dataset:
        every evaluation would otherwise read every index file again for the window offsets."""
        if ds.root not in self.sources:
            self.sources[ds.root] = self.task.source(ds)
        return self.sources[ds.root]

    def example_batch(self, size: int = 1) -> Batch:
        """The first ``size`` samples of the training data (repeated if fewer) as one batch, on
        this rank's device."""
        count = len(self.loader.dataset)
        batch = self.loader.dataset.__getitems__([i % count for i in range(size)])
        return {k: v.to(self.rt.device) if k in self.task.fields() else v for k, v in batch.items()}

    def eval_loader(self) -> Any:
        assert self.eval_ds is not None
        return self.make_loader(self.eval_ds, train=False)[1]

    def agree(self) -> None:
        """Every rank has the same batches per epoch and the same datasets, before the first step."""
        eval_batches = len(self.eval_loader()) if self.eval_ds is not None else 0
        runtime.agree(self.rt, batches_per_epoch=len(self.loader), eval_batches=eval_batches,
                      train_fingerprint=self.train_ds.fingerprint,
                      eval_fingerprint=self.eval_ds.fingerprint if self.eval_ds else "-")

    def batches(self) -> Iterator[Batch]:
        """Endless stream of this rank's batches, epoch after epoch (equal counts on every rank)."""
        epoch = self.sampler.epoch
        while True:
            # within one epoch: reading ahead never crosses set_epoch
            for batch in to_device(self.loader, self.rt.device, self.task.fields()):
                # counted in its own epoch as it is handed out: a step whose micro-batches straddle
                # an epoch's end must not count the old epoch's batches into the new one, or a
                # resume would skip samples that were never trained on
                self.sampler.advance(len(batch["index"]))
                yield batch
            epoch += 1
            self.sampler.set_epoch(epoch)

    def eval_set_size(self) -> int:
        """Units an evaluation counts: the eval set's samples, or its tokens for a language model
        (every window's targets)."""
        if self.eval_ds is None:
            return 0
        source = self.source(self.eval_ds)
        return len(self.eval_ds) if source is None else source.num_windows * source.seq_len
