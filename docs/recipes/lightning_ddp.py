"""Lightning on SLURM with Switchyard (docs/lightning.md): every rank reads its share of the shards,
every eval sample is counted once, and a requeue resumes at the exact next sample.

    switchyard run cluster=slurm parallelism.nodes=2 parallelism.procs_per_node=2 -- \\
        python lightning_ddp.py --train data/train --eval data/eval --epochs 2

The data: samples {"x": float32 [rows, F] (rows vary), "y": int64 class} written with
sharding.DatasetWriter or `python -m jobs.prepare`. tests/sharding/test_lightning.py and
tests/slurm/test_lightning_on_slurm.py run this file as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from sharding.lightning import ShardedDataModule, sample_sums
from switchyard import preemption


class Classifier(pl.LightningModule):
    """Mean of a sample's rows, then a linear layer: small, and it reads the padded batch right."""

    def __init__(self, features: int, classes: int, record: Path | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(features, classes)
        self.record = record

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["x_mask"].unsqueeze(-1).float()  # [B, L, 1]
        pooled = (batch["x"] * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B, F]
        return self.linear(pooled)  # [B, classes]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch), batch["y"], reduction="none")  # [B]
        total, count = sample_sums(loss, batch["is_pad"])  # padding entries count for nothing
        if self.record is not None:  # what this rank trained on, for the tests
            seen = batch["index"][~batch["is_pad"]].tolist()
            with open(self.record / f"seen-rank{self.global_rank}.jsonl", "a") as out:
                out.write(json.dumps({"epoch": self.current_epoch, "index": seen}) + "\n")
        return total / count.clamp(min=1)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = F.cross_entropy(self(batch), batch["y"], reduction="none")  # one value per sample
        total, count = sample_sums(loss, batch["is_pad"])
        self.log_dict({"val_loss_sum": total, "val_samples": count}, reduce_fx="sum", sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.record is not None and not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            with open(self.record / f"val-rank{self.global_rank}.jsonl", "a") as out:
                out.write(json.dumps({"epoch": self.current_epoch,
                                      "val_samples": float(metrics["val_samples"])}) + "\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RequeueOnStop(pl.Callback):
    """SLURM's SIGUSR2 (time limit) or SIGTERM (preemption) reaches switchyard.preemption's flag;
    at the next batch end every rank agrees (``stop_agreed``: a CPU all-reduce over gloo, never a
    GPU sync), the checkpoint (the data module's position included) is written, and on the time
    limit the job asks to be requeued (exit 75). On preemption SLURM decides whether it comes back."""

    def __init__(self, path: Path, stop_after: int | None, sleep_s: float) -> None:
        self.path, self.stop_after, self.sleep_s = path, stop_after, sleep_s
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1
        if trainer.is_global_zero:
            (self.path.parent / "progress").write_text(str(self.batches))
        if self.batches == self.stop_after and not self.path.exists():  # the tests' own signal
            os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(self.sleep_s)
        reason = preemption.stop_agreed()
        if reason is None:
            return
        partial = self.path.with_name(self.path.name + ".partial")
        trainer.save_checkpoint(partial)  # every rank calls it; rank 0 writes
        if trainer.is_global_zero:
            os.replace(partial, self.path)  # never a half-written last.ckpt
        trainer.strategy.barrier()
        if reason == "time_limit":
            preemption.requeue()
        raise SystemExit(f"stopped ({reason}) after batch {self.batches}; checkpoint in {self.path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--record", type=Path, help="write what each rank trained and evaluated on")
    parser.add_argument("--stop-after", type=int, help="send this process SIGUSR2 after N batches")
    parser.add_argument("--sleep-s", type=float, default=0.0, help="per batch, to signal mid-epoch")
    parser.add_argument("--use-distributed-sampler", action="store_true", help="to see it refused")
    args = parser.parse_args()

    preemption.install()  # before anything long: SIGUSR2/SIGTERM set a flag, never kill
    pl.seed_everything(0)
    ckpt = preemption.checkpoint_dir() / "last.ckpt"  # RUN/checkpoints: the same after a requeue
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local_world
    trainer = pl.Trainer(
        accelerator="auto", devices=local_world, num_nodes=nodes,  # one process per GPU (or CPU)
        strategy="ddp" if local_world * nodes > 1 else "auto",
        use_distributed_sampler=args.use_distributed_sampler,  # False: the data module's sampler
        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[RequeueOnStop(ckpt, args.stop_after, args.sleep_s)],
    )
    data = ShardedDataModule(train=args.train, eval=args.eval, batch_size=args.batch_size,
                             num_workers=args.num_workers)
    model = Classifier(args.features, args.classes, args.record)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt if ckpt.exists() else None)
    if trainer.is_global_zero:
        environment = getattr(trainer.strategy, "cluster_environment", None)  # None on one process
        print(f"world {trainer.world_size} via {type(environment).__name__}: "
              f"done after epoch {trainer.current_epoch - 1}, restart {preemption.restart_count()}")
    if torch.distributed.is_initialized():  # Lightning leaves its process group up: a gloo group
        # torn down at exit can abort the process, and so can one destroyed while a peer is still
        # in its last collective (seen on a loaded node: "terminate called without an active
        # exception" after fit); the barrier lets every rank finish before any closes its sockets
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
