"""What every rank runs: build, agree, train, evaluate, summarise.

Loss and metrics treat padding entries (``is_pad``, from the sampler's ``pad`` policy) as absent:
they keep every rank's batch count equal without counting any sample twice. Metrics are reduced
as global sum / global count over all ranks, never one rank's view.

Written for the GPU: a step that does not log never reads a device value on the host (no
``.item()``, no ``float()`` of the loss). Loss sums and sample counts accumulate on the model's
device and are reduced there at log steps; the one value read every step, the stop flag, is a CPU
tensor that rides the process group's gloo backend (``cpu:gloo,cuda:nccl``).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import psutil
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from orchestrator import atomic
from orchestrator.config import ConfigError, MemoryConfig, OptimConfig, TrainConfig, group_dict, import_target
from orchestrator.launch import dist_env, provenance, rendezvous, run_lock, signal_delay
from orchestrator.launch.heartbeat import Heartbeat, interval_for
from orchestrator.telemetry.files import (
    clear_end_summary,
    record_rank_peak,
    register_rank,
    write_end_summary,
)
from orchestrator.telemetry.preflight import preflight
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.summary import summarize
from orchestrator.training import (
    checkpoint,
    checkpointing,
    estimate,
    nonfinite,
    preemption,
    resume,
    runtime,
    startup,
    strategy,
)
from orchestrator.training.device_batches import to_device
from orchestrator.training.microbatch import AutoMicroBatch
from orchestrator.training.run_log import RunLog, flatten
from orchestrator.training.runtime import Runtime
from orchestrator.training.tasks import Task, build_task
from orchestrator.training.throughput import throughput_for
from sharding import ShardedDataset, open_dataset
from sharding.loader import make_loader
from sharding.partition import Policy
from sharding.sampler import ShardedSampler
from sharding.windows import window_loader

Batch = dict[str, torch.Tensor]
NO_STEP = 2**62  # Trainer.first_nonfinite while every step's loss was finite


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite (``optim.on_nonfinite``)."""


@dataclass(frozen=True)
class DataPaths:
    train: str
    eval: str | None


# ------------------------------------------------------------------------------------------------
# Building blocks


def build_model(spec: Any, dataset_kwargs: dict[str, Any], memory: MemoryConfig) -> nn.Module:
    """Instantiate ``spec._target_`` with what the task takes from the dataset (``in_features``
    and ``num_classes``, ``vocab_size``, ...) and the rest of spec as keyword arguments."""
    kwargs = group_dict(spec)
    target = kwargs.pop("_target_", None)
    model_cls = import_target("model", target, "model=mlp, model=transformer, model=gpt")
    try:
        model = model_cls(**dataset_kwargs, **kwargs)
    except TypeError as e:  # an unknown or missing keyword: the user's config, not a bug
        raise ConfigError(f"model._target_={target!r} rejects its arguments: {e} (from the dataset: "
                          f"{sorted(dataset_kwargs)}; from the config: {sorted(kwargs) or 'none'}; "
                          f"fix or remove the model.* key)") from e
    if memory.activation_checkpointing:
        if not hasattr(model, "enable_activation_checkpointing"):
            raise ConfigError(f"memory.activation_checkpointing=true but model {target} has no "
                              f"enable_activation_checkpointing() "
                              f"(try memory.activation_checkpointing=false)")
        model.enable_activation_checkpointing()
    return model


def build_optimizer(params: Any, cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.schedule == "linear":
            return max(1.0 - progress, 0.0)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager[Any]:
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def param_checksum(model: nn.Module) -> str:
    """xxh3 of every parameter's bytes in name order: equal across ranks iff weights are equal."""
    return strategy.checksum(model.named_parameters())


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


class WindowPeaks:
    """This rank's peak memory per logging window, without losing the run's peak.

    torch's peak allocated and reserved bytes (GPU) and the kernel's peak RSS (CPU) only grow. At
    each log step the window's peak is read and then reset (``torch.cuda.reset_peak_memory_stats``;
    ``5`` into ``/proc/self/clear_refs``, which also resets ``ru_maxrss``), and the run's peaks are
    kept here: the summary and the telemetry's peak files take them as their floor. Host calls
    only: reading the allocator's counters does not wait on the GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.run: dict[str, int] = {"allocated": 0, "reserved": 0, "rss": 0}

    def close_window(self) -> int:
        """The peak since the previous call (allocated bytes on a GPU, RSS on CPU); resets it."""
        seen = self.current()
        self.run = {k: max(v, seen[k]) for k, v in self.run.items()}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return seen["allocated"]
        # not Linux, or /proc read-only: the peaks keep growing, as before
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return seen["rss"]

    def current(self) -> dict[str, int]:
        rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0, "rss": rss}
        return {"allocated": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.max_memory_reserved(self.device)), "rss": rss}

    def run_peaks(self) -> dict[str, int]:
        """The run's peaks so far, this window included."""
        return {k: max(v, self.current()[k]) for k, v in self.run.items()}

    def run_peak(self) -> int:
        """What ``peak_memory_bytes`` would say had nothing been reset."""
        peaks = self.run_peaks()
        return peaks["allocated"] if self.device.type == "cuda" else peaks["rss"]


# ------------------------------------------------------------------------------------------------
# One micro-step and evaluation


def batch_loss(model: nn.Module, batch: Batch, task: Task, amp: str, denominator: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss for backward, loss sum, unit count) of one batch, all on the batch's device: reading
    them on the host would stall the GPU.

    The loss divides by a fixed denominator (the task's units per micro-batch x accumulation
    steps) rather than by this batch's real count, so k accumulated micro-batches give exactly the
    gradient of one batch k times larger, and padding entries contribute nothing.
    """
    device = batch["is_pad"].device
    with autocast(device, amp):
        output = task.forward(model, batch)
    total, count = task.loss_sums(output, batch)
    return total / denominator, total.detach(), count


def new_sums(device: torch.device) -> torch.Tensor:
    """[loss sum, unit count, real-sample count], accumulated on the device (float64: exact
    counts past 2**24). Units are samples, or tokens for a language model."""
    return torch.zeros(3, dtype=torch.float64, device=device)


def add_to_sums(sums: torch.Tensor, total: torch.Tensor, count: torch.Tensor, samples: torch.Tensor
                ) -> None:
    sums[0] += total  # in place, promoted to float64: small kernels, no allocation
    sums[1] += count
    sums[2] += samples


GradSync = Callable[[bool], contextlib.AbstractContextManager[Any]]


def backward_micro_batches(model: nn.Module, batches: list[Batch], task: Task, batch_size: int,
                           amp: str, scaler: torch.amp.GradScaler,
                           grad_sync: GradSync | None = None, denominator: float | None = None
                           ) -> torch.Tensor:
    """Accumulate gradients over micro-batches, reducing them only on the last: ``grad_sync(False)``
    around the others (the strategy's; DDP's ``no_sync`` by default). ``amp``: what autocast runs
    (fsdp's own policy casts, so it passes "none"). ``denominator``: the fixed one, when
    ``batches`` are pieces of the loaded batches (``memory.auto_microbatch``).

    Returns [loss sum, unit count, real-sample count] on the batches' device.
    """
    denominator = denominator or task.denominator(batch_size) * len(batches)
    sums = new_sums(batches[0]["is_pad"].device)
    for i, batch in enumerate(batches):
        sync = i == len(batches) - 1
        context = grad_sync(sync) if grad_sync is not None else \
            contextlib.nullcontext() if sync else cast(DistributedDataParallel, model).no_sync()
        with context:
            loss, batch_total, batch_count = batch_loss(model, batch, task, amp, denominator)
            scaler.scale(loss).backward()
        add_to_sums(sums, batch_total, batch_count, (~batch["is_pad"]).sum())
    return sums


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, task: Task, amp: str, rt: Runtime
             ) -> tuple[dict[str, float], int]:
    """(the task's global eval metrics, number of units counted): every eval sample (or window)
    exactly once, padding entries counted in nothing."""
    model.eval()
    sums: torch.Tensor | None = None  # float64 [K] on the device, the task's sums
    for batch in to_device(loader, rt.device, task.fields()):
        with autocast(rt.device, amp):
            output = task.forward(model, batch)
        part = task.eval_sums(output, batch)
        sums = part if sums is None else sums + part
    model.train()
    if sums is None:  # no eval batch on any rank (every rank has the same count)
        return {}, 0
    reduced = runtime.global_sums(rt, sums)  # the one host read of the evaluation
    if not reduced[1]:
        return {}, 0
    return task.eval_metrics(reduced), int(reduced[1])


# ------------------------------------------------------------------------------------------------
# Checkpoint contents


def rng_state() -> dict[str, Any]:
    """Every generator this rank draws from; its CUDA device's too (dropout on a GPU draws there),
    or a resume would not be bit-identical."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if runtime.uses_cuda():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's own
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and runtime.uses_cuda():  # a CPU resume of a GPU run has no stream to restore
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# ------------------------------------------------------------------------------------------------
# The rank's job


class MetricsWindow:
    """Training loss over the last ``log_every_steps`` steps, reduced over all ranks.

    Each rank adds its own loss sum and real-sample count, on its device (no host read); ``close``
    all-reduces both (global sum / global count, never one rank's view) and the peak memory (max
    over ranks, a CPU value over gloo), and rank 0 hands them to the run log (``run_log``) with the
    learning rate and the gradient norm. ``close`` is the window's one host-device sync.
    """

    def __init__(self, rt: Runtime, log: RunLog | None, peaks: WindowPeaks | None = None,
                 unit: str = "samples",
                 throughput: Callable[[float], dict[str, float | None]] = lambda rate: {}) -> None:
        self.rt, self.log, self.unit, self.throughput = rt, log, unit, throughput
        self.peaks = peaks or WindowPeaks(rt.device)
        self.sums, self.start = new_sums(rt.device), time.perf_counter()
        self.last_loss = float("nan")

    def add(self, sums: torch.Tensor) -> None:
        self.sums += sums

    def close(self, step: int, lr: float, grad_norm: torch.Tensor | None) -> tuple[float, float]:
        """(global mean loss per unit, global samples/s) of the window; starts the next one.
        A task counting tokens also logs ``tokens_per_s``, and ``model_tflops_per_s`` and
        ``mfu`` where the model states its FLOPs per token (``throughput``)."""
        total, units, samples = runtime.global_sums(self.rt, self.sums)
        loss = total / units if units > 0 else float("nan")
        seconds = max(time.perf_counter() - self.start, 1e-9)
        rate = samples / seconds
        peak = runtime.global_max(self.rt, self.peaks.close_window())
        if self.log is not None:
            values: dict[str, float | None] = {"train_loss": loss, "samples_per_s": rate, "lr": lr,
                                               "peak_mem_bytes": peak}
            if self.unit != "samples":
                values[f"{self.unit}_per_s"] = units / seconds
                values.update(self.throughput(units / seconds))
            if grad_norm is not None:  # equal on every rank: DDP averaged the gradients
                values["grad_norm"] = float(grad_norm)
            self.log.log(step, finite_or_null(values))
        self.sums.zero_()
        self.start = time.perf_counter()
        self.last_loss = loss
        return loss, rate


class StopPoll:
    """The preemption flag, OR-ed over ranks without a synchronous round trip per step.

    Each step starts an asynchronous all-reduce of this rank's flag and reads the previous step's
    result: every rank reads the same reduced value at the same step, so they all stop together,
    one step after the signal, and the latency hides behind the step's compute.

    The flag is a CPU tensor on purpose: on a GPU run it goes over the group's gloo backend, never
    onto the GPU's stream, and reading it is no host-device sync (Lightning broadcasts its flag as a
    GPU tensor and reads it with ``.item()`` every step, which stalls the GPU).
    """

    def __init__(self, flag: preemption.StopFlag) -> None:
        self.flag = flag
        self.pending: tuple[torch.Tensor, Any] | None = None

    def poll(self) -> preemption.StopReason:
        decided = preemption.StopReason.NONE
        if self.pending is not None:
            buffer, work = self.pending
            work.wait()
            decided = preemption.StopReason(int(buffer.item()))
        buffer = torch.tensor([int(self.flag.reason)], dtype=torch.int64, device="cpu")
        self.pending = (buffer, torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX,
                                                             async_op=True))
        return decided

    def drain(self) -> None:
        """Wait for the last reduction (every rank started it; none may leave it unfinished)."""
        if self.pending is not None:
            self.pending[1].wait()
            self.pending = None


class Trainer:
    """State of one rank's run; ``run()`` is the loop, the rest are its named steps."""

    def __init__(self, cfg: TrainConfig, paths: DataPaths, run_dir: Path, rt: Runtime,
                 pulse: Heartbeat | None = None, clock: startup.Clock | None = None) -> None:
        self.cfg, self.run_dir, self.rt = cfg, run_dir, rt
        self.pulse = pulse  # where this rank is, for the hang verdict (heartbeat's docstring)
        self.clock = clock or startup.Clock()  # where the seconds before the first step go
        self.train_ds: ShardedDataset = open_dataset(paths.train)
        self.eval_ds = open_dataset(paths.eval) if paths.eval else None
        self.eval_path = paths.eval
        self.task = build_task(cfg.task, cfg.data)
        self.sources: dict[Path, Any] = {}  # dataset root -> the task's view of it (``source``)
        self.task.setup(self.train_ds)
        dataset_kwargs = self.task.model_kwargs(self.train_ds)
        self.clock.mark("data")
        runtime.seed_everything(cfg.seed, rt.env.rank)
        self.strategy = strategy.for_run(rt, cfg.parallelism, cfg.memory)
        self.checkpointer = checkpointing.for_run(self.strategy.name, rt, cfg.checkpoint,
                                                  self.checkpoint_dir, self.strategy.module)
        self.model = self.strategy.build(lambda: build_model(cfg.model, dataset_kwargs, cfg.memory))
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.memory.amp == "fp16")
        self.sampler, self.loader = self.make_loader(self.train_ds, train=True)
        # A real batch of the dataset, never a made-up shape (a CNN's pooling needs real sizes).
        example = self.example_batch()
        self.strategy.settle(self.model, lambda model: self.task.forward(model, example))
        self.clock.mark("model")
        self.step = 0
        self.real_samples = torch.zeros((), dtype=torch.int64, device=rt.device)  # trained on; no host read
        self.units = torch.zeros((), dtype=torch.int64, device=rt.device)  # the task's: tokens for an LM
        self.batches_seen = 0
        self.compat = resume.compatibility(cfg, dataset_kwargs, self.train_ds.fingerprint)
        self.stop = preemption.StopFlag()
        self.resumed_from: dict[str, Any] | None = None  # for the summary: where this run continued
        self.checkpoint_warnings: list[str] = []
        self.grad_norm: torch.Tensor | None = None  # of the last step that asked for it
        self.peaks = WindowPeaks(rt.device)
        self.saved_step = -1  # the step of the newest checkpoint this run wrote or loaded
        # on_nonfinite=stop: the first step whose loss was NaN or infinite on this rank, kept on
        # the device (no host read per step) and read where the host syncs anyway: log steps and
        # checkpoints. on_nonfinite=skip: the steps skipped, and how many in a row.
        self.first_nonfinite = torch.full((), NO_STEP, dtype=torch.int64, device=rt.device)
        self.skipped_steps: list[int] = []
        self.skipped_in_a_row = 0
        self.eval_metrics: dict[str, float] = {}  # of the last evaluation
        self.window: MetricsWindow | None = None  # the open training-loss window (run's loop)
        self.window_sums: list[float] | None = None  # a restored checkpoint's open window
        self.micro = AutoMicroBatch(rt, cfg.data.batch_size, cfg.optim.grad_accum_steps, run_dir) \
            if cfg.memory.auto_microbatch else None  # the micro-batch a step runs at, halved at an OOM

    def make_loader(self, ds: ShardedDataset, train: bool) -> tuple[ShardedSampler, Any]:
        """This rank's sampler and loader over ``ds``: the padded batches of its samples, or what
        the task reads instead (a language model's token windows). Evaluation visits every entry
        once in order (pad policy, no shuffle)."""
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

    def example_batch(self) -> Batch:
        """The first sample of the training data as a batch of one, on this rank's device."""
        batch = self.loader.dataset.__getitems__([0])
        return {k: v.to(self.rt.device) if k in self.task.fields() else v for k, v in batch.items()}

    def eval_loader(self) -> Any:
        assert self.eval_ds is not None
        return self.make_loader(self.eval_ds, train=False)[1]

    def agree_before_first_step(self) -> None:
        eval_batches = len(self.eval_loader()) if self.eval_ds is not None else 0
        runtime.agree(self.rt, batches_per_epoch=len(self.loader), eval_batches=eval_batches,
                      train_fingerprint=self.train_ds.fingerprint,
                      eval_fingerprint=self.eval_ds.fingerprint if self.eval_ds else "-")

    def batches(self) -> Iterator[Batch]:
        """Endless stream of this rank's batches, epoch after epoch (equal counts on every rank)."""
        epoch = self.sampler.epoch
        while True:
            # within one epoch: reading ahead never crosses set_epoch
            yield from to_device(self.loader, self.rt.device, self.task.fields())
            epoch += 1
            self.sampler.set_epoch(epoch)

    @property
    def samples_seen(self) -> int:
        """Real samples this rank trained on (a host read: checkpoints and the summary only)."""
        return int(self.real_samples)

    def optimizer_step(self, stream: Iterator[Batch], want_norm: bool = False) -> torch.Tensor:
        """k micro-batches, then one optimizer step; returns [loss sum, real sample count] on the
        device. ``want_norm`` (log steps only): the gradient norm, kept in ``grad_norm``."""
        self.mark("data")
        batches = [next(stream) for _ in range(self.cfg.optim.grad_accum_steps)]
        self.mark("compute")
        # fsdp: its mixed-precision policy casts parameters and inputs; autocast would cast again
        amp = self.cfg.memory.amp if self.strategy.name == "ddp" else "none"
        sums = self.backward(batches, amp)
        self.batches_seen += len(batches)
        self.sampler.advance(sum(len(b["index"]) for b in batches))
        if self.cfg.optim.clip_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            # fsdp: the norm over every rank's shard (torch reduces it before scaling the shards)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad_norm)
            self.grad_norm = self.strategy.global_norm(norm.detach()) if want_norm else None
        elif want_norm:  # a few kernels on a log step; the value stays on the device until logged
            self.scaler.unscale_(self.optimizer)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.grad_norm = self.strategy.global_norm(torch.nn.utils.get_total_norm(grads).detach())
        if self.update_allowed(sums):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            sums = new_sums(sums.device)  # a skipped step trained on nothing and logs nothing
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.step += 1
        if self.cfg.optim.on_nonfinite == "stop":
            self.first_nonfinite.masked_fill_(
                ~torch.isfinite(sums[0]) & (self.first_nonfinite == NO_STEP), self.step)
        self.units += sums[1].to(torch.int64)
        self.real_samples += sums[2].to(torch.int64)
        return sums

    def backward(self, batches: list[Batch], amp: str) -> torch.Tensor:
        """The step's forward and backward, gradients reduced over ranks; ``memory.auto_microbatch``:
        in pieces of the current micro-batch, halved on every rank when one runs out of memory."""
        model, batch_size = self.model, self.cfg.data.batch_size
        if self.micro is None:
            return backward_micro_batches(model, batches, self.task, batch_size, amp, self.scaler,
                                          lambda sync: self.strategy.grad_sync(model, sync))
        denominator = self.task.denominator(batch_size) * len(batches)  # of the loaded batches

        def unreduced(pieces: list[Batch]) -> torch.Tensor:  # the micro-batch module reduces
            return backward_micro_batches(model, pieces, self.task, batch_size, amp, self.scaler,
                                          lambda sync: self.strategy.grad_sync(model, False), denominator)

        return self.micro.step(self.step + 1, batches, unreduced,
                               lambda: self.optimizer.zero_grad(set_to_none=True),
                               self.strategy.module(model))

    def update_allowed(self, sums: torch.Tensor) -> bool:
        """optim.on_nonfinite=skip: whether this step's loss, and its gradients, are finite on every
        rank (one all-reduced flag, read on the host: skip's cost per step). A grad scaler (fp16)
        handles its own overflowing gradients by lowering the scale, so with one only the loss
        counts here. stop: always (``check_finite`` reads the flag later)."""
        if self.cfg.optim.on_nonfinite != "skip":
            return True
        bad = ~torch.isfinite(sums[0])
        if not self.scaler.is_enabled():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = self.strategy.global_norm(torch.nn.utils.get_total_norm(grads).detach())
            bad = bad | ~torch.isfinite(norm)
        flag = bad.to(torch.int64).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            self.skipped_in_a_row = 0
            return True
        self.note_skipped(self.step + 1)
        if self.scaler.is_enabled():  # no scaler.step: update() would find no inf check recorded
            self.scaler.update(self.scaler.get_scale())
        return False

    def note_skipped(self, step: int) -> None:
        self.skipped_steps.append(step)
        self.skipped_in_a_row += 1
        if self.rt.is_main:
            print(f"warning: step {step}: the loss or a gradient is NaN or infinite on some rank; its "
                  f"update was skipped (optim.on_nonfinite=skip)", flush=True)
        if self.skipped_in_a_row >= self.cfg.log_every_steps:  # the model no longer trains
            raise NonFiniteLossError(
                f"the last {self.skipped_in_a_row} steps (to step {step}) all had a NaN or infinite "
                f"loss or gradient and were skipped (optim.on_nonfinite=skip): the model no longer "
                f"trains. {self.nonfinite_advice()}")

    def check_finite(self) -> None:
        """optim.on_nonfinite=stop: fail on every rank, naming the first step whose loss was NaN
        or infinite on any rank. A collective and one host read: log steps and checkpoints only."""
        first = self.first_nonfinite.clone()
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
        step = int(first.item())
        if step == NO_STEP:
            return
        saved = f"step {self.saved_step}" if self.saved_step > 0 else "none"
        raise NonFiniteLossError(
            f"the training loss was NaN or infinite at step {step} (optim.on_nonfinite=stop): the run "
            f"stopped at step {self.step} without checkpointing the weights those steps made "
            f"(newest checkpoint: {saved}, in {self.checkpoint_dir}). {self.nonfinite_advice()}")

    def nonfinite_advice(self) -> str:
        return (f"Try a lower optim.lr (now {self.cfg.optim.lr}), optim.clip_grad_norm=1.0, or check "
                f"the data for NaN; optim.on_nonfinite=skip skips such steps instead")

    def save_checkpoint(self, blocking: bool = False) -> None:
        """Save this step through the strategy's checkpointer (``checkpointing``): under ddp with
        ``checkpoint.async_save`` the loop waits only for a host copy of the state. ``blocking``
        (a stop, the end): the save, and any still in the background, are on disk on return. A
        step already saved is not written again."""
        if self.saved_step == self.step:
            if blocking:
                self.checkpointer.wait()
            return
        self.check_finite()  # never a checkpoint of NaN weights as the newest good state
        self.mark("checkpoint")
        self.checkpointer.save(self.step, self.model, self.optimizer, self.train_state(), blocking=blocking)
        if blocking:
            self.checkpointer.wait()
        self.saved_step = self.step

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model and optimizer state, assembled in one place:
        the step, schedule, grad scaler, sampler position, every rank's RNG streams and counts, what
        the resuming run must share (``compat``) and the world size. Collective."""
        # The open metrics window's sums too: a requeue mid-window logs, at the window's end, the
        # mean over all of its steps (not only those after the resume).
        window = self.window.sums.tolist() if self.window is not None else None
        per_rank = runtime.gather(self.rt, {"rng": rng_state(), "samples": self.samples_seen,
                                            "units": int(self.units), "batches": self.batches_seen,
                                            "window": window})
        return {"step": self.step, "schedule": self.schedule.state_dict(),
                "scaler": self.scaler.state_dict(), "sampler": self.sampler.state_dict(),
                "per_rank": per_rank, "compat": self.compat, "world_size": self.rt.env.world_size,
                "micro_batch": self.micro.as_summary() if self.micro is not None else None,
                "provenance": provenance.for_checkpoint(self.run_dir),
                "optim": resume.optim_record(self.cfg.optim)}

    def restore(self) -> None:
        """Continue from the newest readable checkpoint of this run, or from
        ``checkpoint.resume_from`` (what a resume continues from and may change: ``resume``).

        An unreadable newest checkpoint is reported and the previous one used; every rank loads the
        same one (the checkpointer's ``find``: under ddp rank 0 chooses and tells the others, under
        fsdp every rank checks its share of the files and they agree).
        """
        started = time.perf_counter()
        found = self.checkpointer.find()
        named = resume.source(self.cfg, self.run_dir, found.path if found else None,
                              resume.writer(found.state) if found else None)
        if named is not None:
            found = self.checkpointer.find(named)
            if found is None:
                raise checkpoint.CheckpointError(
                    f"checkpoint.resume_from={self.cfg.checkpoint.resume_from!r} holds no checkpoint "
                    f"(name a step-N.pt or step-N.dcp, or a checkpoint.dir that holds them)")
        if found is None:
            return
        self.checkpoint_warnings = [f"skipped unreadable checkpoint {note}" for note in found.skipped]
        if not found.verified:
            self.checkpoint_warnings.append(f"{found.path.name} has no checksum (written by an older "
                                            f"Switchyard): loaded unverified")
        for warning in self.checkpoint_warnings if self.rt.is_main else ():
            print(f"warning: {warning}", flush=True)
        state = found.state
        resume.check_compatible(state["compat"], self.compat, found.path)
        resume.check_max_steps(int(state["step"]), self.cfg.optim, found.path)
        code_change = resume.check_code(state.get("provenance"), found.path,
                                        self.cfg.checkpoint.allow_code_change)
        if code_change is not None:
            self.checkpoint_warnings.append(f"resumed under other code (checkpoint.allow_code_change="
                                            f"true): {provenance.describe_change(code_change)}")
        self.checkpointer.load(found, self.model, self.optimizer)
        self.schedule.load_state_dict(state["schedule"])
        resume.apply_optim(self.optimizer, self.schedule, self.cfg.optim)  # not the checkpoint's lr
        self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        if self.micro is not None:  # a resume starts at the micro-batch the run had come down to
            self.micro.restore(state.get("micro_batch"))
        counts = resume.carried_counts(state["per_rank"], self.rt.env.world_size, self.rt.env.rank)
        self.real_samples.fill_(counts.samples)
        self.units.fill_(counts.units)
        self.batches_seen = counts.batches
        if state["world_size"] == self.rt.env.world_size:  # the same rank keeps its own streams
            mine = state["per_rank"][self.rt.env.rank]
            set_rng_state(mine["rng"])
            self.window_sums = mine.get("window")
        else:  # the window is reduced as one global sum: rank 0 carries all of the old ranks' part
            old = [r["window"] for r in state["per_rank"] if r.get("window") is not None]
            self.window_sums = [sum(column) for column in zip(*old, strict=True)] \
                if old and self.rt.is_main else None
        changes = resume.config_changes(state.get("optim"), self.cfg.optim)
        self.resumed_from = {"path": str(found.path), "step": self.step,
                             "load_s": time.perf_counter() - started, "code_change": code_change,
                             "run_dir": resume.writer(state), "config_changes": changes,
                             "resume_from": self.cfg.checkpoint.resume_from if named else None}
        self.saved_step = self.step
        if self.rt.is_main:
            print("\n".join(provenance.resume_lines(self.resumed_from)), flush=True)

    def stop_for(self, reason: preemption.StopReason) -> None:
        """Checkpoint, then requeue (time limit) or leave it to SLURM (preemption), then exit."""
        self.save_checkpoint(blocking=True)
        env, cap = self.rt.env, self.cfg.cluster.max_requeues
        if reason == preemption.StopReason.TIME_LIMIT and env.source == "slurm":
            if env.restart_count >= cap:
                raise preemption.RequeueLimitError(
                    f"job {env.job_id} reached its time limit again after {env.restart_count} requeues "
                    f"(cluster.max_requeues={cap}); checkpoint at step {self.step} is in "
                    f"{self.checkpoint_dir}. Raise cluster.max_requeues or cluster.timeout_min, or "
                    f"rerun with hydra.run.dir={self.run_dir} to continue.")
            if env.is_main:
                preemption.requeue(env.job_id)
                print(f"requeued job {env.job_id} at step {self.step} "
                      f"({env.restart_count + 1}/{cap} requeues)", flush=True)
        elif env.is_main:
            print(f"stopped by {reason.name} at step {self.step}; checkpoint in {self.checkpoint_dir}",
                  flush=True)
        raise preemption.JobStopped(-1, reason.name)

    @property
    def checkpoint_dir(self) -> Path:
        return resume.checkpoint_dir(self.cfg, self.run_dir)

    def mark(self, phase: str) -> None:
        if self.pulse is not None:
            self.pulse.mark(self.step, phase)

    def due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.stop.install()
        self.agree_before_first_step()
        self.restore()
        self.clock.mark("resume")
        cfg, rt = self.cfg, self.rt
        log = RunLog(cfg.logger, self.run_dir, self.step, flatten(asdict(cfg))) if rt.is_main else None
        try:
            return self._loop(log, start)
        finally:
            if log is not None:
                log.close()

    def _loop(self, log: RunLog | None, start: float) -> dict[str, Any]:
        cfg, rt = self.cfg, self.rt
        stream, stops = self.batches(), StopPoll(self.stop)
        if self.resumed_from is not None:  # process start -> first step, the checkpoint's load included
            self.resumed_from["resume_s"] = time.time() - psutil.Process().create_time()
        window = MetricsWindow(rt, log, self.peaks, self.task.unit,
                               throughput_for(self.strategy.module(self.model), rt.device,
                                              cfg.memory.amp, rt.env.world_size, cfg.memory.tf32))
        if self.window_sums is not None:
            window.sums.copy_(torch.tensor(self.window_sums, dtype=window.sums.dtype))
        self.window = window
        eval_loss, eval_counted = float("nan"), 0
        with tqdm(total=cfg.optim.max_steps, initial=self.step, desc="train", unit="step",
                  disable=not rt.is_main, dynamic_ncols=True) as bar:
            while self.step < cfg.optim.max_steps:
                logs = (self.step + 1) % cfg.log_every_steps == 0 or self.step + 1 == cfg.optim.max_steps
                window.add(self.optimizer_step(stream, want_norm=logs))
                self.clock.mark("first_step")  # a dict lookup after the first
                if self.micro is not None and self.micro.unlogged:  # the step whose micro-batch halved
                    if log is not None:
                        for change in self.micro.unlogged:
                            log.log(change["step"], {"micro_batch_size": change["micro_batch_size"]})
                    self.micro.unlogged.clear()
                last = self.step == cfg.optim.max_steps
                if logs:
                    self.check_finite()
                    lr = float(self.schedule.get_last_lr()[0])
                    loss, rate = window.close(self.step, lr, self.grad_norm)
                    bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
                bar.update(1)
                if self.eval_ds is not None and self.due(cfg.eval_every_steps):
                    eval_loss, eval_counted = self.evaluate(log)
                if self.due(cfg.checkpoint.every_steps):
                    self.save_checkpoint()
                self.checkpointer.poll()  # a background save that failed fails the run here
                reason = stops.poll()
                if reason != preemption.StopReason.NONE and not last:
                    stops.drain()
                    self.stop_for(reason)
        stops.drain()
        self.clock.mark("last_step")
        if self.eval_ds is not None and not self.due(cfg.eval_every_steps):
            eval_loss, eval_counted = self.evaluate(log)
        self.save_checkpoint(blocking=True)  # on disk, whole, before the process can exit
        self.clock.mark("final_checkpoint")
        return self.summarise(window.last_loss, eval_loss, eval_counted, time.perf_counter() - start)

    def evaluate(self, log: RunLog | None) -> tuple[float, int]:
        """Every eval sample (or window) once; rank 0 logs the task's metrics at this step."""
        self.mark("eval")
        amp = self.cfg.memory.amp if self.strategy.name == "ddp" else "none"
        metrics, counted = evaluate(self.model, self.eval_loader(), self.task, amp, self.rt)
        if not all(math.isfinite(value) for value in metrics.values()):  # every rank: global metrics
            self.save_checkpoint(blocking=True)  # the training was sound (checked): its steps are kept
            nonfinite.check_eval(metrics, self.step, self.eval_path,
                                 f"step {self.step} is checkpointed in {self.checkpoint_dir}")
        if log is not None and metrics:
            log.log(self.step, finite_or_null(metrics))
        self.eval_metrics = metrics
        return metrics.get("eval_loss", float("nan")), counted

    def eval_set_size(self) -> int:
        """Units an evaluation counts: the eval set's samples, or its tokens for a language model
        (every window's targets)."""
        if self.eval_ds is None:
            return 0
        source = self.source(self.eval_ds)
        return len(self.eval_ds) if source is None else source.num_windows * source.seq_len

    def summarise(self, train_loss: float, eval_loss: float, eval_counted: int, wall_s: float
                  ) -> dict[str, Any]:
        saves = self.checkpointer.stats.as_summary()
        on_slurm = self.cfg.cluster.mode == "slurm"  # only SLURM sends the signal
        chosen = signal_delay.recorded(self.run_dir) if on_slurm else None  # and why: summary.json
        late = signal_delay.lead_time_warning(signal_delay.submitted_seconds(self.cfg.cluster, self.run_dir),
                                              saves["checkpoint_slowest_save_s"])
        if late is not None and on_slurm:
            self.checkpoint_warnings.append(late)
        per_rank = runtime.gather(self.rt, {
            "samples": self.samples_seen, "units": int(self.units), "batches": self.batches_seen,
            "checksum": self.strategy.param_checksum(self.model), "peak": self.peaks.run_peak(),
            "node": self.rt.env.hostname})
        summary = {
            "world_size": self.rt.env.world_size, "steps": self.step,
            "samples_per_rank": [r["samples"] for r in per_rank],
            **({f"{self.task.unit}_per_rank": [r["units"] for r in per_rank]}
               if self.task.unit != "samples" else {}),
            "batches_per_rank": [r["batches"] for r in per_rank],
            "param_checksum_per_rank": [r["checksum"] for r in per_rank],
            "final_train_loss": train_loss, "final_eval_loss": eval_loss,
            "eval_samples_counted": eval_counted, "eval_set_size": self.eval_set_size(),
            "task": type(self.task).__name__, "unit": self.task.unit,
            "final_eval_metrics": self.eval_metrics,
            "wall_s": wall_s, "peak_mem_bytes_per_rank": [r["peak"] for r in per_rank],
            "node_per_rank": [r["node"] for r in per_rank], "backend": self.rt.backend,
            "resumed_from": self.resumed_from, "checkpoint_warnings": self.checkpoint_warnings,
            "auto_microbatch": self.micro.as_summary() if self.micro is not None else None,
            "skipped_nonfinite_steps": self.skipped_steps, **saves, "signal_delay": chosen,
            "resume_s": self.resumed_from["resume_s"] if self.resumed_from else None,
        }
        return finite_or_null(summary)  # what summary.json, the caller and the terminal all get


def finite_or_null(value: Any) -> Any:
    """NaN and infinities as None: strict JSON parsers reject NaN (no eval set: no eval loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    atomic.write_json(run_dir / "summary.json", summary, indent=2)


def train_rank(cfg: TrainConfig, paths: DataPaths, run_dir: str) -> dict[str, Any]:
    """The function each rank runs (submitted through submitit in every mode, or in place when
    attached to the user's own srun or torchrun).

    Rank 0 holds the run directory's lock, and the checkpoint directory's, for the whole run
    (``run_lock``). Preflight runs before
    the process group, so a GPU-count mismatch fails in seconds instead of after the rendezvous;
    one memory sampler per node (local rank 0) runs for the whole job.
    """
    env, run = dist_env.detect(), Path(run_dir)
    with contextlib.ExitStack() as held:
        if env.is_main:
            owner = f"job {env.job_id} (rank 0, pid {os.getpid()} on {env.hostname})"
            with before_rendezvous(env, run):
                held.enter_context(run_lock.hold(run, owner))
                checkpoints = resume.checkpoint_dir(cfg, run)
                if checkpoints.resolve() != run.resolve():
                    held.enter_context(run_lock.hold(checkpoints, owner, "checkpoint.dir"))
        return _train_rank(cfg, paths, run, env)


@contextlib.contextmanager
def before_rendezvous(env: dist_env.DistEnv, run: Path) -> Iterator[None]:
    """Rank 0 failing here tells the ranks waiting for its address, so they stop with its reason."""
    try:
        yield
    except ConfigError as e:
        rendezvous.publish_failure(rendezvous.endpoint_file(run / "rendezvous", env), str(e))
        raise


def _train_rank(cfg: TrainConfig, paths: DataPaths, run: Path, env: dist_env.DistEnv) -> dict[str, Any]:
    clock = startup.Clock()
    clock.mark("imports")  # the interpreter, the imports and submitit's unpickling: all before here
    if cfg.deterministic:  # first: cuBLAS takes its workspace setting when the rank first uses CUDA
        runtime.enable_determinism()
    uuids = runtime.cuda_uuids(cfg.parallelism.gpus_per_node)  # NVML finds the GPUs by UUID
    report = preflight(cfg.parallelism.gpus_per_node, env.local_rank, env.local_world_size, cuda_uuids=uuids)
    print(report.describe(), flush=True)
    register_rank(run, env.rank, env.local_rank, env.hostname, report.device_index,
                  device_uuid=runtime.device_uuid(uuids, report.device_index))
    clock.mark("preflight")
    if env.is_main:
        clear_end_summary(run)
    sampler = MemorySampler(run, env.hostname, cfg.telemetry.interval_s, cuda_uuids=uuids,
                            attempt=env.restart_count) \
        if cfg.telemetry.enabled and env.is_local_main else None
    rt = runtime.start(env, cfg.parallelism, cfg.cluster, run / "rendezvous", report.device_index, run)
    clock.mark("rendezvous")
    runtime.check_bf16(rt.device, cfg.memory.amp)  # where submission could not name the GPU
    runtime.set_tf32(rt.device, cfg.memory.tf32)
    pulse = Heartbeat(run, env.rank, env.hostname, interval_for(cfg.cluster.collective_timeout_s))
    try:
        with pulse:
            with sampler or contextlib.nullcontext():
                rank_trainer = Trainer(cfg, paths, run, rt, pulse, clock)
                runtime.report_nccl_transport(rt)  # the model's broadcast has connected NCCL
                summary = rank_trainer.run()
            pulse.mark(summary["steps"], "done")
            record_rank_peak(run, env.rank, report.device_index, floor=rank_trainer.peaks.run_peaks())
            torch.distributed.barrier()  # every node's sampler has stopped and every peak is written
        if rt.is_main:
            summary["memory"] = summarize(run)
            summary["memory_estimate"] = estimate.read_report(run)  # jobs.train wrote it
            clock.mark("result")
            summary["startup_s"], summary["ending_s"] = clock.startup_s(), clock.ending_s()
            print(startup.describe(summary["startup_s"]), flush=True)
            write_summary(run, summary)
            for flag in summary["memory"]["flags"]:
                print(f"memory warning: {flag}", flush=True)
        return summary
    except Exception:
        if env.is_main and cfg.telemetry.enabled:
            keep_end_summary(run)
        raise
    finally:
        runtime.stop()


def keep_end_summary(run: Path) -> None:
    """Rank 0 of a failing run: its memory section, summarised once for ``switchyard status``.
    Never raises: the run's own error is what the job reports."""
    try:
        write_end_summary(run, summarize(run))
    except Exception as e:
        print(f"could not summarise the telemetry at the failure: {type(e).__name__}: {e}", flush=True)
