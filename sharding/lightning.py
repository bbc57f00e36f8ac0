"""Switchyard's shards as a LightningDataModule, with exact mid-epoch resume (docs/lightning.md).

    from sharding.lightning import ShardedDataModule, sample_sums

    dm = ShardedDataModule(train="data/train", eval="data/eval", batch_size=32)
    trainer = Trainer(..., use_distributed_sampler=False)   # the module's sampler splits the data
    trainer.fit(model, datamodule=dm, ckpt_path=...)        # the checkpoint carries its position

Each rank reads its own share of the shards: the loaders are ``make_loader`` over a
``ShardedSampler`` built from the trainer's ``world_size`` and ``global_rank``. Every rank gets
the same number of batches (``policy="pad"`` fills the last ones with flagged ``is_pad`` entries,
so no rank waits forever in an all-reduce), and ``sample_sums`` keeps those entries out of the
metrics. The training sampler is advanced at the start of each training batch, so a checkpoint
saved at any batch end holds the exact position; a resume at another world size splits what is
left of the epoch over the new ranks (``ShardedSampler.load_state_dict``).

Lightning is an optional extra (``pip install switchyard[lightning]``): this module imports it
when a name is first taken from it. Either package works: ``lightning`` (``lightning.pytorch``)
or the standalone ``pytorch_lightning``; the one your script already imported is used (a
datamodule of the other one's class would be refused by its Trainer).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
import sys
from types import ModuleType
from typing import Any, cast

import torch

from sharding import lease
from sharding.loader import ShardedLoader, make_loader
from sharding.partition import Policy
from sharding.reader import ShardedDataset, open_dataset
from sharding.sampler import ShardedSampler

PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # the two import names of Lightning
STATE_VERSION = 1
REFUSAL = ("Trainer(use_distributed_sampler=True) would replace ShardedDataModule's sampler, and "
           "ranks would read other samples than it records: build the Trainer with "
           "Trainer(use_distributed_sampler=False)")


class LightningSetupError(ValueError):
    """A Trainer or state that does not fit the data module; the message is one line."""


def sample_sums(values: torch.Tensor, is_pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ``values`` over real entries, number of real entries), both float 0-d tensors.

    ``values`` [B] is a per-sample metric (a loss with ``reduction="none"``, a 0/1 correct flag);
    ``is_pad`` [B] the batch's flags. Log both with ``reduce_fx="sum", sync_dist=True``: over an
    epoch on all ranks they add up to every eval sample exactly once, and their ratio is the mean.
    """
    if values.shape != is_pad.shape:
        raise ValueError(f"sample_sums: values has shape {tuple(values.shape)} but is_pad has "
                         f"{tuple(is_pad.shape)}: pass one value per sample (reduction='none')")
    real = ~is_pad.to(device=values.device, dtype=torch.bool)  # bool [B]
    total = torch.where(real, values.float(), torch.zeros((), device=values.device)).sum()
    return total, real.sum().float()


def lightning_package() -> ModuleType:
    """``lightning.pytorch`` or ``pytorch_lightning``: the one already imported, else the first
    one installed."""
    for name in PACKAGES:
        if name in sys.modules:
            return sys.modules[name]
    for name in PACKAGES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("sharding.lightning needs Lightning: pip install 'switchyard[lightning]' "
                      "(or pytorch-lightning)")


class _EpochLoader(ShardedLoader):
    """A ShardedLoader whose length is a whole epoch's batches at this world size, and which
    Lightning sees as resumable (``state_dict``/``load_state_dict``: its ``_Stateful``).

    Lightning takes the length once per fit: it ends an epoch, and runs that epoch's validation,
    when its batch count reaches it. A resumed epoch continues Lightning's count from the
    checkpoint, while the sampler yields only what is left (``batches_left``), so the count
    starts at ``batches_before``: the whole epoch's batches less those left. At another world
    size that is not the count the checkpoint holds (the batches done were of another size), and
    the data module moves Lightning's count there (``_DataModuleCore.train_dataloader``).
    """

    batches_before = 0  # Lightning's count of this epoch's batches done before the loader's first
    module: _DataModuleCore

    def batches_left(self) -> int:
        """The batches the sampler has left to yield in this epoch (all of them in a fresh one)."""
        return ShardedLoader.__len__(self)

    def __len__(self) -> int:
        return self.batches_before + self.batches_left()

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands, as Lightning saves a resumable loader's state. The position
        itself is restored from the data module's state (``ShardedDataModule.state_dict``), which
        Lightning loads before this one: that one holds the sampler's exact place, and this one
        only has to agree with it on the epoch (its batch count is Lightning's, which a resume at
        another world size moves)."""
        return self.module._position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.module._position()
        if state and state.get("epoch") != mine["epoch"]:
            raise LightningSetupError(f"the checkpoint's training loader is at epoch {state.get('epoch')} "
                                      f"but its ShardedDataModule state at epoch {mine['epoch']}: the "
                                      f"checkpoint was changed after it was written; resume from another one")


class _DataModuleCore:
    """ShardedDataModule's behaviour, mixed into the LightningDataModule of either package.

    ``train``/``eval``: dataset directories (``DatasetWriter`` or ``jobs.prepare``); either may be
    left out. ``batch_size`` entries per rank and step (``eval_batch_size``, default the same);
    ``num_workers`` DataLoader workers per rank (they ignore SIGTERM/SIGUSR2, left to the trainer);
    ``group_by_length`` batches training entries of similar length (less padding, resume still
    exact); ``policy`` "pad" (every sample each epoch, flagged padding) or "drop" (no padding, up
    to world_size-1 samples left out) for training; eval always pads, so every sample counts once.
    ``seed`` orders each epoch's shuffle. Needs ``Trainer(use_distributed_sampler=False)``.
    """

    trainer: Any

    def __init__(
        self,
        train: str | os.PathLike[str] | None = None,
        eval: str | os.PathLike[str] | None = None,  # the issue's and the docs' name
        *,
        batch_size: int,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        group_by_length: bool = False,
        policy: Policy = "pad",
        seed: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if train is None and eval is None:
            raise ValueError("ShardedDataModule needs train=PATH, eval=PATH or both")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: must be >= 1")
        self.train_path, self.eval_path = train, eval
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers, self.group_by_length, self.policy = num_workers, group_by_length, policy
        self.seed, self.pin_memory = seed, pin_memory
        self.train_sampler: ShardedSampler | None = None
        self.eval_sampler: ShardedSampler | None = None
        self._train_loader: _EpochLoader | None = None
        self._eval_loader: ShardedLoader | None = None
        self._batches_done = 0  # training batches of epoch _batches_epoch started so far
        self._batches_epoch = 0
        self._pending: dict[str, Any] | None = None  # a loaded state, applied once the loader exists
        self._resumed = False  # a state was applied and the training loader not yet taken since
        self._train_fingerprint = ""
        self._whole_epoch = 0  # training batches per rank in a whole epoch at this world size
        self._fitted_by: Any = None  # the Trainer the training loader and its callback are for
        self._leases: contextlib.ExitStack | None = None  # rank 0's, from setup to teardown

    # -- Lightning hooks -------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is None:
            raise LightningSetupError("ShardedDataModule.setup needs a Trainer: pass the module to "
                                      "trainer.fit(model, datamodule=dm)")
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise LightningSetupError(REFUSAL)
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        if rank == 0 and self._leases is None:
            self._leases = self._hold_leases()
        # A Trainer of its own for each fit: a second Trainer (a new fit of the same module) gets a
        # fresh sampler at its world size and the callback that advances it; a checkpoint it
        # resumes from is applied below, as for the first.
        if self.train_path is not None and stage == "fit" and self._fitted_by is not trainer:
            self._fitted_by, self._batches_done, self._batches_epoch = trainer, 0, 0
            dataset = open_dataset(self.train_path)
            self.train_sampler = ShardedSampler(dataset.shard_counts, world_size=world, rank=rank,
                                                seed=self.seed, policy=self.policy)
            loader = self._loader(dataset, self.train_sampler, self.batch_size, self.group_by_length)
            loader.__class__ = _EpochLoader  # same object, a length Lightning's resume can trust
            epoch_loader = cast(_EpochLoader, loader)
            epoch_loader.module = self
            self._whole_epoch = epoch_loader.batches_left()  # a fresh sampler: a whole epoch's batches
            self._train_loader = epoch_loader
            self._train_fingerprint = dataset.fingerprint
            advance = _classes()[1]
            mine = [c for c in trainer.callbacks if getattr(c, "module", None) is self]
            if not any(isinstance(c, advance) for c in mine):
                trainer.callbacks.append(advance(self))
        if self.eval_path is not None and self._eval_loader is None:
            dataset = open_dataset(self.eval_path)
            # pad, never drop: every eval sample is read once over all ranks, equal counts per rank
            self.eval_sampler = ShardedSampler(dataset.shard_counts, world_size=world, rank=rank,
                                               seed=self.seed, policy="pad", shuffle=False)
            self._eval_loader = self._loader(dataset, self.eval_sampler, self.eval_batch_size, False)
        if self._pending is not None and self.train_sampler is not None:
            self._apply(self._pending)

    def teardown(self, stage: str) -> None:
        if self._leases is not None:
            self._leases.close()
            self._leases = None

    def _hold_leases(self) -> contextlib.ExitStack:
        """A lease on each dataset (``sharding.lease``), so ``jobs.prepare overwrite=true`` of one
        is refused while this run reads it, naming the run."""
        owner = (f"a Lightning run (rank 0, pid {os.getpid()} on {socket.gethostname()}, "
                 f"{os.path.basename(sys.argv[0]) if sys.argv else 'python'} in {os.getcwd()})")
        leases = contextlib.ExitStack()
        for path in {self.train_path, self.eval_path} - {None}:
            leases.enter_context(lease.hold(str(path), owner))
        return leases

    def train_dataloader(self) -> ShardedLoader:
        if self._train_loader is None or self.train_sampler is None:
            raise LightningSetupError("ShardedDataModule has no training data: pass train=PATH")
        epoch = int(self.trainer.current_epoch)
        self.train_sampler.set_epoch(epoch)  # a fresh epoch; the loaded one continues as it is
        loader = self._train_loader
        done = self._batches_this_epoch()
        # the resumed epoch ends, and validates, where a whole one does
        loader.batches_before = max(self._whole_epoch - loader.batches_left(), 0) if done else 0
        if self._resumed and done != loader.batches_before:
            _move_batch_count(self.trainer, loader.batches_before - done)
            self._batches_done = loader.batches_before  # counted as Lightning counts from here
        self._resumed = False
        return loader

    def val_dataloader(self) -> ShardedLoader:
        if self._eval_loader is None:
            raise LightningSetupError("ShardedDataModule has no eval data: pass eval=PATH")
        return self._eval_loader

    def test_dataloader(self) -> ShardedLoader:
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position (the same on every rank); saved in the checkpoint."""
        if self.train_sampler is None:
            return {}
        return {"version": STATE_VERSION, "sampler": self.train_sampler.state_dict(),
                "batches_done": self._batches_this_epoch(), "fingerprint": self._train_fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise LightningSetupError(f"ShardedDataModule state version={state.get('version')!r}; "
                                      f"this code reads version {STATE_VERSION}")
        self._pending = dict(state)
        if self.train_sampler is not None:
            self._apply(self._pending)

    # -- internals -------------------------------------------------------------------------

    def _apply(self, state: dict[str, Any]) -> None:
        if self.train_sampler is None:
            raise LightningSetupError("ShardedDataModule has no training sampler to resume")
        saved = state.get("fingerprint")  # absent in checkpoints written before it was recorded
        if saved is not None and saved != self._train_fingerprint:
            raise LightningSetupError(
                f"ShardedDataModule(train={str(self.train_path)!r}) is dataset {self._train_fingerprint}, "
                f"but the checkpoint was trained on dataset {saved}: the data changed since (another "
                f"dataset, or this one prepared again), so its position means other samples here; "
                f"resume with the dataset it was trained on, or start a new run without ckpt_path")
        self.train_sampler.load_state_dict(state["sampler"])
        # Lightning resumes its batch count from the checkpoint: at the same world size or
        # another, this stretch's batches follow the ones done (see _EpochLoader).
        self._batches_done, self._batches_epoch = int(state["batches_done"]), self.train_sampler.epoch
        self._pending, self._resumed = None, True

    def _loader(self, dataset: ShardedDataset, sampler: ShardedSampler, batch_size: int,
                group_by_length: bool) -> ShardedLoader:
        return make_loader(dataset, sampler, batch_size, num_workers=self.num_workers,
                           pin_memory=self.pin_memory, group_by_length=group_by_length,
                           # the trainer's stop signals are the main process's to act on
                           worker_ignores=(signal.SIGTERM, signal.SIGUSR2))

    def _advance(self, batch: Any) -> None:
        """One training batch started: its entries count as consumed once it trains."""
        if self.train_sampler is None:
            return
        self.train_sampler.advance(len(batch["index"]))
        self._batches_done = self._batches_this_epoch() + 1
        self._batches_epoch = self.train_sampler.epoch

    def _position(self) -> dict[str, Any]:
        """The training epoch and Lightning's count of its batches started (every rank alike)."""
        epoch = self.train_sampler.epoch if self.train_sampler is not None else 0
        return {"epoch": epoch, "batches_done": self._batches_this_epoch()}

    def _batches_this_epoch(self) -> int:
        """Training batches started in the sampler's epoch (Lightning sets each epoch on the
        sampler itself, so a count of another epoch is stale)."""
        if self.train_sampler is None or self._batches_epoch != self.train_sampler.epoch:
            return 0
        return self._batches_done


def _move_batch_count(trainer: Any, by: int) -> None:
    """Move Lightning's count of the current epoch's training batches by ``by``, keeping how its
    counters (ready, started, processed, completed) stand to each other, which its restart logic
    reads. Only at a resume at another world size: the checkpoint counted batches of another
    size, and the epoch must end at a whole epoch's count here for its validation to run."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    progress = getattr(loop, "batch_progress", None)
    if progress is None:
        return  # no Lightning loop to move (a stand-in trainer)
    counts = progress.current
    for name in ("ready", "started", "processed", "completed"):
        setattr(counts, name, max(getattr(counts, name) + by, 0))


def _advance_callback_class(pl: ModuleType) -> type:
    class Advance(pl.Callback):  # type: ignore[name-defined]
        """Advances the data module's sampler when a training batch starts, so a checkpoint
        written at that batch's end (ModelCheckpoint, a preemption save) counts it."""

        def __init__(self, module: _DataModuleCore) -> None:
            self.module = module

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.module._advance(batch)

    return Advance


_CLASSES: dict[str, tuple[type, type]] = {}


def _classes() -> tuple[type, type]:
    pl = lightning_package()
    if pl.__name__ not in _CLASSES:
        module = type("ShardedDataModule", (_DataModuleCore, pl.LightningDataModule),
                      {"__module__": __name__, "__doc__": _DataModuleCore.__doc__,
                       "__qualname__": "ShardedDataModule"})
        _CLASSES[pl.__name__] = (module, _advance_callback_class(pl))
    return _CLASSES[pl.__name__]


def __getattr__(name: str) -> Any:
    if name == "ShardedDataModule":
        return _classes()[0]
    raise AttributeError(f"module 'sharding.lightning' has no attribute {name!r}")
