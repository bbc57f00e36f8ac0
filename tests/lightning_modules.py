"""The Lightning module and callback that tests/sharding/test_lightning.py fits in-process. They live
here, imported inside the tests, so that only the pytest worker that runs those tests imports
Lightning (about 3 s of CPU, torchmetrics and transformers with it), not every worker's collection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch

from sharding.lightning import ShardedDataModule


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.linear(batch["x"].sum(1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """Records each training batch's real samples; saves a checkpoint at batch `save_at`."""

    def __init__(self, save_at: int | None = None, path: Path | None = None) -> None:
        self.batches: list[list[int]] = []
        self.save_at, self.path = save_at, path

    def on_train_batch_end(self, trainer: object, module: object, outputs: object,
                           batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.batches.append(batch["index"][~batch["is_pad"]].tolist())
        if len(self.batches) == self.save_at and self.path is not None:
            trainer.save_checkpoint(self.path)  # type: ignore[attr-defined]


class AtTrainStart(pl.Callback):
    """Calls ``probe()`` when training starts (the data module is set up, its leases held)."""

    def __init__(self, probe: Callable[[], None]) -> None:
        self.probe = probe

    def on_train_start(self, trainer: object, module: object) -> None:
        self.probe()


def trainer(**options: object) -> pl.Trainer:
    """A one-process CPU Trainer with nothing the tests do not look at."""
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **options)  # type: ignore[arg-type]


def fit(data: Path, recorder: Recorder, ckpt: Path | None = None) -> None:
    dm = ShardedDataModule(train=data / "train", batch_size=8, group_by_length=True, seed=3)
    trainer(max_epochs=2, use_distributed_sampler=False, callbacks=[recorder]).fit(
        Tiny(), datamodule=dm, ckpt_path=ckpt)
