"""The training loop of one rank: build, agree, restore, train, evaluate, checkpoint, summarise.

The loop knows no task, no checkpoint format and no strategy: the step's maths is ``step``, what
varies sits behind ``tasks``, ``checkpointing`` and ``strategy``, and each piece of state a
checkpoint keeps saves and restores itself (``train_state``). Around it: the metrics window and
memory peaks (``metrics``), the NaN/inf guard (``nonfinite``), preemption polling
(``preemption``); the rank process's start-up and shutdown are ``rank_process``.

Metrics are reduced as global sum / global count over all ranks, never one rank's view. Written
for the GPU: a step that does not log never reads a device value on the host (no ``.item()``, no
``float()`` of the loss); the one value read every step, the stop flag, is a CPU tensor that rides
the process group's gloo backend (``cpu:gloo,cuda:nccl``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from orchestrator.config import TrainConfig
from orchestrator.launch import provenance, restarts, signal_delay
from orchestrator.launch.heartbeat import Heartbeat
from orchestrator.training import (
    checkpointing,
    compiling,
    exporting,
    nonfinite,
    preemption,
    profiling,
    resume,
    runtime,
    startup,
    strategy,
)
from orchestrator.training.checkpoint import CheckpointError, Found
from orchestrator.training.loaders import RankData
from orchestrator.training.metrics import MetricsWindow, WindowPeaks, finite_or_null
from orchestrator.training.microbatch import AutoMicroBatch
from orchestrator.training.nonfinite import NonFiniteGuard
from orchestrator.training.run_log import RunLog, flatten
from orchestrator.training.runtime import Runtime
from orchestrator.training.step import (
    Batch,
    autocast,
    backward_micro_batches,
    build_model,
    build_optimizer,
    build_schedule,
    evaluate,
    new_sums,
    optimizer_implementation,
    optimizer_kernels,
)
from orchestrator.training.stragglers import Lateness
from orchestrator.training.tasks import build_task
from orchestrator.training.throughput import throughput_for
from orchestrator.training.train_state import Counters, RngState, TrainState


@dataclass(frozen=True)
class DataPaths:
    train: str
    eval: str | None


class Trainer:
    """State of one rank's run; ``run()`` is the loop, the rest are its named steps."""

    def __init__(self, cfg: TrainConfig, paths: DataPaths, run_dir: Path, rt: Runtime,
                 pulse: Heartbeat | None = None, clock: startup.Clock | None = None) -> None:
        self.cfg, self.run_dir, self.rt = cfg, run_dir, rt
        self.pulse = pulse  # where this rank is, for the hang verdict (heartbeat's docstring)
        self.clock = clock or startup.Clock()  # where the seconds before the first step go
        self.task = build_task(cfg.task, cfg.data)
        self.data = RankData(cfg, rt, self.task, paths.train, paths.eval)
        self.task.setup(self.data.train_ds)
        dataset_kwargs = self.task.model_kwargs(self.data.train_ds)
        self.clock.mark("data")
        runtime.seed_everything(cfg.seed, rt.env.rank)
        self.strategy = strategy.for_run(rt, cfg.parallelism, cfg.memory)
        self.amp = self.strategy.autocast_amp(cfg.memory.amp)  # what the step's autocast runs
        self.checkpointer = checkpointing.for_run(self.strategy.name, rt, cfg.checkpoint,
                                                  self.checkpoint_dir, self.strategy.module)
        self.exporter = exporting.Exporter(cfg.checkpoint, run_dir, self.checkpoint_dir,
                                           cfg.optim.max_steps) \
            if cfg.checkpoint.export and rt.is_main else None  # checkpoint.export: rank 0, off the loop
        if self.exporter is not None:
            self.checkpointer.after_save = self.exporter.saved
        self.compile_spec = compiling.spec_of(cfg.model)  # activation checkpointing, compile, wrap
        self.compiled_units = 0
        self.model = self.strategy.build(lambda: self.compiled(build_model(cfg.model, dataset_kwargs,
                                                                           cfg.memory)))
        self.kernels = optimizer_kernels(cfg.optim, rt.device)  # optim.implementation
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, rt.device)
        self.schedule = build_schedule(self.optimizer, cfg.optim)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=cfg.memory.amp == "fp16")
        self.data.open_train()
        # A real batch of the dataset, never a made-up shape (a CNN's pooling needs real sizes).
        example = self.data.example_batch()
        self.compile_report: compiling.CompileReport | None = None
        self.recompiles: compiling.Recompiles | None = None
        if self.compile_spec.enabled:  # the warm-up settles DDP's buckets as settle() would
            self.clock.mark("model")
            self.compile_report, self.recompiles = compiling.prepare(
                self.compile_spec, self.compiled_units, cfg, run_dir, rt.is_main,
                self.warm_up)
            self.clock.mark("compile")
        else:
            self.strategy.settle(self.model, lambda model: self.task.forward(model, example))
            self.clock.mark("model")
        self.step = 0
        self.counters = Counters(rt)
        self.compat = resume.compatibility(cfg, dataset_kwargs, self.data.train_ds.fingerprint)
        self.stop = preemption.StopFlag()
        self.resumed_from: dict[str, Any] | None = None  # for the summary: where this run continued
        self.checkpoint_warnings: list[str] = []
        self.grad_norm: torch.Tensor | None = None  # of the last step that asked for it
        self.peaks = WindowPeaks(rt.device)
        self.window = MetricsWindow(rt, None, self.peaks, self.task.unit,
                                    throughput_for(self.strategy.module(self.model), rt.device,
                                                   cfg.memory.amp, rt.env.world_size, cfg.memory.tf32))
        self.lateness = Lateness(rt, run_dir, cfg.telemetry.slow_rank_fraction,
                                 cfg.telemetry.slow_rank_windows)
        self.saved_step = -1  # the step of the newest checkpoint this run wrote or loaded
        self.first_step_at: float | None = None  # wall time the first step of this start ended
        self.guard = NonFiniteGuard(cfg.optim, cfg.log_every_steps, rt)
        self.eval_metrics: dict[str, float] = {}  # of the last evaluation
        self.micro = AutoMicroBatch(rt, cfg.data.batch_size, cfg.optim.grad_accum_steps, run_dir) \
            if cfg.memory.auto_microbatch else None  # the micro-batch a step runs at, halved at an OOM
        self.state = TrainState(rt, {"schedule": self.schedule, "scaler": self.scaler,
                                     "sampler": self.data.sampler, "micro_batch": self.micro},
                                [RngState(rt), self.counters, self.window])

    # -- compile --------------------------------------------------------------------------------

    def compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.compile_spec.enabled:  # the blocks chosen before fsdp renames their classes
            self.compiled_units = compiling.compile_in_place(model, self.compile_spec,
                                                             self.cfg.parallelism.fsdp_units)
        return model

    def warm_up(self) -> None:
        """Every compiled block compiled now, on a batch of the step's shape, under the step's
        autocast (``compiling.warm_up``)."""
        full = self.data.example_batch(self.cfg.data.batch_size)

        def forward(model: torch.nn.Module) -> torch.Tensor:
            with autocast(self.rt.device, self.amp):
                return self.task.forward(model, full)

        compiling.warm_up(self.model, forward, self.rt.device)

    def compile_summary(self) -> dict[str, Any] | None:
        if self.compile_report is None:
            return None
        if self.recompiles is not None:
            self.compile_report.recompiles = self.recompiles.count
        return asdict(self.compile_report)

    # -- the step -------------------------------------------------------------------------------

    def optimizer_step(self, stream: Iterator[Batch], want_norm: bool = False) -> torch.Tensor:
        """k micro-batches, then one optimizer step; returns [loss sum, unit count, real-sample
        count] on the device. ``want_norm`` (log steps only): the gradient norm, in ``grad_norm``."""
        self.mark("data")
        batches = [next(stream) for _ in range(self.cfg.optim.grad_accum_steps)]
        self.mark("compute")
        self.lateness.enter()  # one wall-clock read: how late this rank heads for the reduction
        sums = self.backward(batches)
        self.counters.batches += len(batches)  # the stream advanced the sampler as it handed them out
        if self.cfg.optim.clip_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            # fsdp: the norm over every rank's shard (torch reduces it before scaling the shards)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad_norm)
            self.grad_norm = self.strategy.global_norm(norm.detach()) if want_norm else None
        elif want_norm:  # a few kernels on a log step; the value stays on the device until logged
            self.scaler.unscale_(self.optimizer)
            self.grad_norm = self.gradient_norm()
        # a grad scaler (fp16) handles overflowing gradients itself, by lowering its scale
        if self.guard.update_allowed(self.step + 1, sums[0],
                                     None if self.scaler.is_enabled() else self.gradient_norm):
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.scaler.is_enabled():  # no scaler.step: update() would find no inf check recorded
                self.scaler.update(self.scaler.get_scale())
            sums = new_sums(sums.device)  # a skipped step trained on nothing and logs nothing
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.step += 1
        self.guard.note(self.step, sums[0])
        self.counters.add(sums)
        return sums

    def gradient_norm(self) -> torch.Tensor:
        """The global norm of the gradients, on the device (a collective under fsdp)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return self.strategy.global_norm(torch.nn.utils.get_total_norm(grads).detach())

    def backward(self, batches: list[Batch]) -> torch.Tensor:
        """The step's forward and backward, gradients reduced over ranks; ``memory.auto_microbatch``:
        in pieces of the current micro-batch, halved on every rank when one runs out of memory."""
        model, batch_size, amp = self.model, self.cfg.data.batch_size, self.amp
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

    def check_finite(self) -> None:
        self.guard.check(self.step, self.saved_step, self.checkpoint_dir)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, blocking: bool = False) -> None:
        """Save this step through the strategy's checkpointer (``checkpointing``): with
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
        """What a checkpoint holds besides the model and optimizer state (``train_state``), with
        what the resuming run must share (``compat``) and what it may change. Collective."""
        return self.state.state_dict(self.step, {
            "compat": self.compat, "provenance": provenance.for_checkpoint(self.run_dir),
            "optim": resume.optim_record(self.cfg.optim)})

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
                raise CheckpointError(
                    f"checkpoint.resume_from={self.cfg.checkpoint.resume_from!r} holds no checkpoint "
                    f"(name a step-N.pt or step-N.dcp, or a checkpoint.dir that holds them)")
        if found is None:
            return
        code_change = self.check_resumable(found)
        self.checkpointer.load(found, self.model, self.optimizer)
        self.state.load_state_dict(found.state)
        # not the checkpoint's lr, nor its optimizer kernels
        resume.apply_optim(self.optimizer, self.schedule, self.cfg.optim, self.kernels)
        self.step = self.saved_step = int(found.state["step"])
        changes = resume.config_changes(found.state.get("optim"), self.cfg.optim)
        self.resumed_from = {"path": str(found.path), "step": self.step,
                             "load_s": time.perf_counter() - started, "code_change": code_change,
                             "run_dir": resume.writer(found.state), "config_changes": changes,
                             "resume_from": self.cfg.checkpoint.resume_from if named else None}
        if self.rt.is_main:
            print("\n".join(provenance.resume_lines(self.resumed_from)), flush=True)

    def check_resumable(self, found: Found) -> dict[str, Any] | None:
        """The checkpoint fits this run (``resume``'s checks); its warnings kept and printed once.
        Returns the code change a resume was allowed to make, if any."""
        self.checkpoint_warnings = [f"skipped unreadable checkpoint {note}" for note in found.skipped]
        if not found.verified:
            self.checkpoint_warnings.append(f"{found.path.name} has no checksum (written by an older "
                                            f"Switchyard): loaded unverified")
        for warning in self.checkpoint_warnings if self.rt.is_main else ():
            print(f"warning: {warning}", flush=True)
        resume.check_compatible(found.state["compat"], self.compat, found.path)
        resume.check_max_steps(int(found.state["step"]), self.cfg.optim, found.path)
        code_change = resume.check_code(found.state.get("provenance"), found.path,
                                        self.cfg.checkpoint.allow_code_change, self.run_dir)
        if code_change is not None:
            self.checkpoint_warnings.append(f"resumed under other code (checkpoint.allow_code_change="
                                            f"true): {provenance.describe_change(code_change)}")
        return code_change

    @property
    def checkpoint_dir(self) -> Path:
        return resume.checkpoint_dir(self.cfg, self.run_dir)

    # -- the loop -------------------------------------------------------------------------------

    def mark(self, phase: str) -> None:
        if self.pulse is not None:
            self.pulse.mark(self.step, phase)

    def due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.stop.install()
        self.data.agree()
        self.restore()
        self.clock.mark("resume")
        cfg, rt = self.cfg, self.rt
        log = RunLog(cfg.logger, self.run_dir, self.step, flatten(asdict(cfg))) if rt.is_main else None
        try:
            with compiling.limit_errors(self.recompiles, self.compile_spec.recompile_limit):
                return self._loop(log, start)
        finally:
            if log is not None:
                log.close()

    def _loop(self, log: RunLog | None, start: float) -> dict[str, Any]:
        cfg, window = self.cfg, self.window
        stream, stops = self.data.batches(), preemption.StopPoll(self.stop)
        if self.resumed_from is not None:  # process start -> first step, the checkpoint's load included
            self.resumed_from["resume_s"] = time.time() - startup.process_start_time()
        window.begin(log)
        eval_loss, eval_counted = float("nan"), 0
        profiler = profiling.StepProfiler(cfg.profile_steps, cfg.log_every_steps, self.run_dir / "profile",
                                          self.rt.env.rank, self.rt.device, self.rt.is_main)
        with profiler, tqdm(total=cfg.optim.max_steps, initial=self.step, desc="train", unit="step",
                  disable=not self.rt.is_main, dynamic_ncols=True) as bar:
            while self.step < cfg.optim.max_steps:
                logs = (self.step + 1) % cfg.log_every_steps == 0 or self.step + 1 == cfg.optim.max_steps
                window.add(self.optimizer_step(stream, want_norm=logs))
                profiler.step()
                if self.clock.mark("first_step"):  # a dict lookup after the first
                    runtime.start_training_timeout(cfg.cluster)
                    self.first_step_at = time.time()  # a restart's delay ends here (summary)
                self.log_micro_batch_changes(log)
                last = self.step == cfg.optim.max_steps
                if logs:
                    self.check_finite()
                    lr = float(self.schedule.get_last_lr()[0])
                    notes = self.lateness.payload()  # rides the window's CPU collective
                    loss, rate = window.close(self.step, lr, self.grad_norm, notes)
                    self.lateness.take(notes)
                    bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
                bar.update(1)
                if self.data.eval_ds is not None and self.due(cfg.eval_every_steps):
                    eval_loss, eval_counted = self.evaluate(log)
                if self.due(cfg.checkpoint.every_steps):
                    self.save_checkpoint()
                self.checkpointer.poll()  # a background save that failed fails the run here
                reason = stops.poll()
                if reason != preemption.StopReason.NONE and not last:
                    stops.drain()
                    self.save_checkpoint(blocking=True)
                    if self.exporter is not None:  # the time left is the checkpoint's, not an export's
                        self.exporter.abandon()
                    preemption.leave(reason, self.rt.env, cfg.cluster.max_requeues, self.step,
                                     self.checkpoint_dir, self.run_dir)
        stops.drain()
        self.clock.mark("last_step")
        if self.data.eval_ds is not None and not self.due(cfg.eval_every_steps):
            eval_loss, eval_counted = self.evaluate(log)
        self.save_checkpoint(blocking=True)  # on disk, whole, before the process can exit
        if self.exporter is not None:  # the last export too: the job must not end under it
            self.exporter.finish()
        self.clock.mark("final_checkpoint")
        return self.summarise(window.last_loss, eval_loss, eval_counted, time.perf_counter() - start)

    def log_micro_batch_changes(self, log: RunLog | None) -> None:
        """Rank 0 logs the step whose micro-batch halved (``memory.auto_microbatch``)."""
        if self.micro is None:
            return
        if log is not None:
            for change in self.micro.unlogged:
                log.log(change["step"], {"micro_batch_size": change["micro_batch_size"]})
        self.micro.unlogged.clear()

    def evaluate(self, log: RunLog | None) -> tuple[float, int]:
        """Every eval sample (or window) once; rank 0 logs the task's metrics at this step. A
        NaN or infinite metric fails the run, once this step is checkpointed (``nonfinite``)."""
        self.mark("eval")
        metrics, counted = evaluate(self.model, self.data.eval_loader(), self.task, self.amp, self.rt)
        if not nonfinite.all_finite(metrics):  # every rank alike: the metrics are global
            self.save_checkpoint(blocking=True)  # the training was sound (checked): its steps are kept
            nonfinite.check_eval(metrics, self.step, self.data.eval_path,
                                 f"step {self.step} is checkpointed in {self.checkpoint_dir}")
        if log is not None and metrics:
            log.log(self.step, finite_or_null(metrics))
        self.eval_metrics = metrics
        return metrics.get("eval_loss", float("nan")), counted

    # -- the result -----------------------------------------------------------------------------

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
            "samples": self.counters.samples, "units": int(self.counters.units),
            "batches": self.counters.batches, "checksum": self.strategy.param_checksum(self.model),
            "peak": self.peaks.run_peak(), "node": self.rt.env.hostname})
        summary = {
            "world_size": self.rt.env.world_size, "steps": self.step,
            "samples_per_rank": [r["samples"] for r in per_rank],
            **({f"{self.task.unit}_per_rank": [r["units"] for r in per_rank]}
               if self.task.unit != "samples" else {}),
            "batches_per_rank": [r["batches"] for r in per_rank],
            "param_checksum_per_rank": [r["checksum"] for r in per_rank],
            "final_train_loss": train_loss, "final_eval_loss": eval_loss,
            "eval_samples_counted": eval_counted, "eval_set_size": self.data.eval_set_size(),
            "task": type(self.task).__name__, "unit": self.task.unit,
            "final_eval_metrics": self.eval_metrics,
            "wall_s": wall_s, "peak_mem_bytes_per_rank": [r["peak"] for r in per_rank],
            "node_per_rank": [r["node"] for r in per_rank], "backend": self.rt.backend,
            "resumed_from": self.resumed_from, "checkpoint_warnings": self.checkpoint_warnings,
            "auto_microbatch": self.micro.as_summary() if self.micro is not None else None,
            "skipped_nonfinite_steps": self.guard.skipped_steps, **saves, "signal_delay": chosen,
            "resume_s": self.resumed_from["resume_s"] if self.resumed_from else None,
            "compile": self.compile_summary(),
            "optim_implementation": optimizer_implementation(self.optimizer),
            **self.lateness.as_summary(),
            **restarts.summary(self.rt.env.restart, self.first_step_at),
            "exports": self.exporter.stats.as_summary() if self.exporter is not None else None,
        }
        return finite_or_null(summary)  # what summary.json, the caller and the terminal all get
