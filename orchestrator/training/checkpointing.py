"""One checkpoint interface: save, find the newest good one, load, prune; one implementation per
format, chosen by the strategy. The trainer calls this and never branches on the format.

- ``SingleFile`` (ddp): rank 0 writes ``step-N.pt`` (``checkpoint``), the model and optimizer state
  whole. With ``checkpoint.async_save=true`` the step loop waits only for a copy of the state in
  host memory (into buffers kept across saves, pinned on a GPU); the serialisation, the write, the
  fsync, the checksum, the atomic publish and the pruning run on a background thread. A save still
  running when the next is due is waited for; the save at a preemption or at the end is blocking.
  A background failure (a full disk) is raised at the next step boundary, naming the path.
- ``Sharded`` (fsdp): every rank writes its shards into ``step-N.dcp/`` (``sharded_checkpoint``).
  With ``async_save`` the loop waits only for each rank's copy of its own shards in host memory
  (DCP's staging helpers: buffers kept across saves, pinned on a GPU); DCP's write, the train
  state, the checksums and rank 0's publish run on a background thread on every rank. Their
  collectives (DCP's plan exchange, the checksum gather, the barriers) go over a gloo group of
  their own, made once at start-up: a background collective on the training's group could pair
  with a training collective of another rank and hang or corrupt both, and on GPUs it keeps every
  checkpoint collective on the host, off NCCL's streams.

Either way a checkpoint appears only when whole, and a process killed at any moment leaves the
previous checkpoint as the newest good one (the next save removes what the killed one left).
"""

from __future__ import annotations

import abc
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.config import CheckpointConfig
from orchestrator.training import checkpoint, runtime, sharded_checkpoint
from orchestrator.training.checkpoint import CheckpointError, Found
from orchestrator.training.runtime import Runtime


@dataclass
class SaveStats:
    """What saving cost this run: for summary.json."""

    saves: int = 0
    blocking_s: float = 0.0  # the step loop's waits: the host copy, and any wait for an earlier save
    save_s: float = 0.0  # wall time of the saves, start to publish, background included
    save_s_per_save: list[float] = field(default_factory=list)

    def as_summary(self) -> dict[str, Any]:
        return {"checkpoint_saves": self.saves, "checkpoint_blocking_s": self.blocking_s,
                "checkpoint_save_s": self.save_s,
                "checkpoint_slowest_save_s": max(self.save_s_per_save, default=0.0)}


class Checkpointer(abc.ABC):
    """The interface. ``save``, ``find`` and ``load`` are collective: every rank calls them. A
    format that lacks one of its methods fails when it is built, not at its first save."""

    kind = ""  # the strategy whose checkpoints these are: "ddp" or "fsdp"

    def __init__(self, rt: Runtime, cfg: CheckpointConfig, directory: Path) -> None:
        self.rt, self.cfg, self.directory = rt, cfg, directory
        self.stats = SaveStats()
        self.pending: _Background | None = None
        # rank 0, once a checkpoint is published (step, path, on the loop's thread?): the exporter
        self.after_save: Callable[[int, Path, bool], None] | None = None

    def _published(self, step: int, path: Path, on_loop: bool) -> None:
        if self.after_save is not None and self.rt.is_main:
            self.after_save(step, path, on_loop)

    @abc.abstractmethod
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any], *, blocking: bool) -> None:
        """Write ``step``: the model, the optimizer and ``train_state`` (``train_state``)."""

    def poll(self) -> None:
        """Raise a background save's failure (at a step boundary); never waits."""
        if self.pending is not None and self.pending.done():
            self._join()

    def wait(self) -> None:
        """The loop waits for a background save (a stop, the end): counted as blocking."""
        started = time.perf_counter()
        try:
            self._join()
        finally:
            self.stats.blocking_s += time.perf_counter() - started

    def _join(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.join()
        self._record(pending.seconds)
        if isinstance(pending.error, CheckpointError):  # already names the path and the cause
            raise CheckpointError(f"the background save failed: {pending.error}") from pending.error
        if pending.error is not None:
            raise CheckpointError(f"the background save of {pending.path} failed: "
                                  f"{type(pending.error).__name__}: {pending.error}") from pending.error

    def _record(self, seconds: float) -> None:
        self.stats.save_s += seconds
        self.stats.save_s_per_save.append(seconds)

    def find(self, source: Path | None = None) -> Found | None:
        """The newest good checkpoint of ``directory``, or of ``source`` (``checkpoint.resume_from``:
        a checkpoint, or a directory of them), skipping damaged ones (with why), the same on every
        rank; a checkpoint of the other strategy is refused, naming both."""
        listed = runtime.broadcast(self.rt, [str(p) for p in checkpoint.candidates(source or self.directory)]
                                   if self.rt.is_main else None)
        if not listed:
            return None
        check_kind(Path(listed[0]), self.kind)
        return self._find([Path(p) for p in listed])

    @abc.abstractmethod
    def _find(self, listed: list[Path]) -> Found | None:
        """The newest good one of ``listed`` (newest first), the same on every rank."""

    @abc.abstractmethod
    def load(self, found: Found, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The model's and the optimizer's state from ``found``, onto this rank's."""


def check_kind(newest: Path, kind: str) -> None:
    """The newest checkpoint was written by this strategy: not silently skipped or misread."""
    written = "fsdp" if sharded_checkpoint.is_sharded(newest) else "ddp"
    if written != kind:
        raise CheckpointError(
            f"cannot resume from {newest}: it was written with parallelism.strategy={written} and "
            f"this run has parallelism.strategy={kind} (resume with parallelism.strategy={written}, "
            f"or use a new run directory or checkpoint.dir)")


class SingleFile(Checkpointer):
    kind = "ddp"

    def __init__(self, rt: Runtime, cfg: CheckpointConfig, directory: Path,
                 module: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__(rt, cfg, directory)
        self.module = module  # DDP's wrapper -> the model whose state is saved
        self.host = HostCopy()

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any], *, blocking: bool) -> None:
        started = time.perf_counter()
        if self.rt.is_main:
            self._join()  # one save at a time: the host buffers are the previous save's until it ends
            state = {**train_state, "model": self.module(model).state_dict(),
                     "optimizer": optimizer.state_dict()}
            if blocking or not self.cfg.async_save:
                path = checkpoint.save(self.directory, step, state, self.cfg.keep_last)
                self._record(time.perf_counter() - started)
                self._published(step, path, True)
            else:
                staged = self.host.copy(state)
                self.pending = _Background(
                    checkpoint.path_for(self.directory, step), started,
                    lambda: self._published(
                        step, checkpoint.save(self.directory, step, staged, self.cfg.keep_last), False))
        dist.barrier()  # no rank runs ahead of the state being copied (or written, when blocking)
        self.stats.saves += 1
        self.stats.blocking_s += time.perf_counter() - started

    def _find(self, listed: list[Path]) -> Found | None:
        found = checkpoint.load_latest(listed[0].parent, listed) if self.rt.is_main else None
        chosen = runtime.broadcast(self.rt, str(found.path) if found else None)
        if chosen is None:
            return None
        return found or checkpoint.load_path(Path(chosen))

    def load(self, found: Found, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module(model).load_state_dict(found.state["model"])
        optimizer.load_state_dict(found.state["optimizer"])


class Sharded(Checkpointer):
    kind = "fsdp"

    def __init__(self, rt: Runtime, cfg: CheckpointConfig, directory: Path) -> None:
        super().__init__(rt, cfg, directory)
        # Collective: every rank builds its checkpointer at the same point of start-up.
        self.group = dist.new_group(backend="gloo") if cfg.async_save else None
        self.host = ShardCopy(on_gpu=rt.device.type == "cuda")

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any], *, blocking: bool) -> None:
        started = time.perf_counter()
        self._join()  # one save at a time: its group's collectives run in the same order everywhere
        shards = sharded_checkpoint.tensors(model, optimizer)
        if blocking or not self.cfg.async_save:
            path = sharded_checkpoint.save(self.directory, step, shards, train_state, self.cfg.keep_last)
            self._record(time.perf_counter() - started)
            self._published(step, path, True)
        else:
            staged, group = self.host.copy(shards), self.group
            self.pending = _Background(
                sharded_checkpoint.path_for(self.directory, step), started,
                lambda: self._published(step, sharded_checkpoint.save(
                    self.directory, step, staged, train_state, self.cfg.keep_last, group), False))
        self.stats.saves += 1
        self.stats.blocking_s += time.perf_counter() - started

    def _find(self, listed: list[Path]) -> Found | None:
        path, skipped = sharded_checkpoint.choose([p for p in listed if sharded_checkpoint.is_sharded(p)])
        if path is None:
            return None
        state = sharded_checkpoint.train_state(path)
        return Found(path=path, step=int(state["step"]), state=state, skipped=tuple(skipped))

    def load(self, found: Found, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        sharded_checkpoint.load(found.path, model, optimizer)


def for_run(strategy_name: str, rt: Runtime, cfg: CheckpointConfig, directory: Path,
            module: Callable[[nn.Module], nn.Module]) -> Checkpointer:
    if strategy_name == "fsdp":
        return Sharded(rt, cfg, directory)
    return SingleFile(rt, cfg, directory, module)


class HostCopy:
    """A copy of a state dict's tensors in host memory, into buffers kept from one save to the next
    (pinned on a GPU, so the copies are DMA and run together; one sync at the end). The training
    may change the originals as soon as ``copy`` returns."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, state: Any) -> Any:
        copied = self._copy(state, "")
        if torch.cuda.is_available() and self._any_cuda:
            torch.cuda.synchronize()  # every non-blocking copy has landed before the thread reads
        return copied

    _any_cuda = False

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, dict):
            # A shallow copy keeps the type and attributes (a state dict's OrderedDict and its
            # `_metadata`, which load_state_dict reads): the bytes equal a blocking save's.
            out = copy.copy(value)
            for k, v in value.items():
                out[k] = self._copy(v, f"{key}/{k}")
            return out
        if isinstance(value, list | tuple):
            return type(value)(self._copy(v, f"{key}/{i}") for i, v in enumerate(value))
        return value  # ints, floats, strings, RNG tuples: immutable or rebuilt on every save

    def _tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        source = tensor.detach()
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                 pin_memory=source.is_cuda)
            self.buffers[key] = buffer
        self._any_cuda = self._any_cuda or source.is_cuda
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer


class ShardCopy:
    """This rank's shards (DTensors) copied into host buffers kept from one save to the next, with
    DCP's own staging helpers (what its async stager uses): pinned on a GPU, the copies
    non-blocking, one sync at the end. The training may change the originals once ``copy`` returns."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        self.buffers: dict[str, Any] | None = None
        self.layout: list[tuple[str, Any]] = []

    def copy(self, shards: dict[str, Any]) -> dict[str, Any]:
        # here, not at the top: it imports DTensor and torch._dynamo, only an fsdp run's to pay
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(shards, "")
        if self.buffers is None or layout != self.layout:  # e.g. the optimizer's state appeared
            self.buffers = _create_cpu_state_dict(shards, pin_memory=self.on_gpu)
            self.layout = layout
        staged = _copy_state_dict(shards, self.buffers, non_blocking=self.on_gpu)
        if self.on_gpu:
            torch.cuda.synchronize()  # every copy has landed before the background thread reads
        return staged


def _layout(value: Any, key: str) -> list[tuple[str, Any]]:
    """Every tensor's place, shape and dtype: buffers made for one layout cannot take another."""
    if isinstance(value, torch.Tensor):
        return [(key, (tuple(value.shape), value.dtype))]
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _layout(v, f"{key}/{k}")]
    if isinstance(value, list | tuple):
        return [item for i, v in enumerate(value) for item in _layout(v, f"{key}/{i}")]
    return []


class _Background:
    """One save on its own thread: serialise, write, fsync, checksum, publish, prune."""

    def __init__(self, path: Path, started: float, write: Callable[[], object]) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._started = started
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-{path.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as e:  # reported by the trainer's thread at the next step boundary
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self._started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
