"""The training metrics of one logging window, reduced over all ranks, and this rank's memory peaks.

Written for the GPU: a step that does not log never reads a device value on the host. Loss sums
and sample counts accumulate on the model's device and are reduced there at log steps
(``MetricsWindow.close``, the window's one host-device sync).
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from orchestrator.training import runtime
from orchestrator.training.run_log import RunLog
from orchestrator.training.runtime import Runtime
from orchestrator.training.step import new_sums


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
        rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0, "rss": rss}
        return {"allocated": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.max_memory_reserved(self.device)), "rss": rss}

    def run_peaks(self) -> dict[str, int]:
        """The run's peaks so far, this window included."""
        return {k: max(v, self.current()[k]) for k, v in self.run.items()}

    def run_peak(self) -> int:
        """The run's peak as if nothing had been reset: allocated bytes on a GPU, RSS on CPU."""
        peaks = self.run_peaks()
        return peaks["allocated"] if self.device.type == "cuda" else peaks["rss"]


class MetricsWindow:
    """Training loss over the last ``log_every_steps`` steps, reduced over all ranks.

    Each rank adds its own loss sum and real-sample count, on its device (no host read); ``close``
    all-reduces both (global sum / global count, never one rank's view) and the peak memory (max
    over ranks, a CPU value over gloo), and rank 0 hands them to the run log (``run_log``) with the
    learning rate and the gradient norm. ``close`` is the window's one host-device sync.

    A checkpoint keeps every rank's open window (``state_dict``): a requeue mid-window logs, at the
    window's end, the mean over all of its steps, not only those after the resume.
    """

    def __init__(self, rt: Runtime, log: RunLog | None, peaks: WindowPeaks | None = None,
                 unit: str = "samples",
                 throughput: Callable[[float], dict[str, float | None]] = lambda rate: {}) -> None:
        self.rt, self.log, self.unit, self.throughput = rt, log, unit, throughput
        self.peaks = peaks or WindowPeaks(rt.device)
        self.sums, self.start = new_sums(rt.device), time.perf_counter()
        self.last_loss = float("nan")

    def begin(self, log: RunLog | None) -> None:
        """The loop starts: its log, and the window's clock from now (not from the start-up)."""
        self.log, self.start = log, time.perf_counter()

    def add(self, sums: torch.Tensor) -> None:
        self.sums += sums

    def close(self, step: int, lr: float, grad_norm: torch.Tensor | None,
              also_max: torch.Tensor | None = None) -> tuple[float, float]:
        """(global mean loss per unit, global samples/s) of the window; starts the next one.
        A task counting tokens also logs ``tokens_per_s``, and ``model_tflops_per_s`` and
        ``mfu`` where the model states its FLOPs per token (``throughput``). ``also_max``: int64
        values on the host reduced by MAX in the same CPU collective as the peak memory, in place
        (the slow-rank notes, ``stragglers``: no collective of their own)."""
        total, units, samples = runtime.global_sums(self.rt, self.sums)
        loss = total / units if units > 0 else float("nan")
        seconds = max(time.perf_counter() - self.start, 1e-9)
        rate = samples / seconds
        peak = runtime.global_max(self.rt, self.peaks.close_window(), also_max)
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

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint (a host read: checkpoints only)."""
        return {"window": self.sums.tolist()}

    def load_state_dict(self, ranks: list[dict[str, Any]]) -> None:
        """Every saved rank's part. The same world: this rank's own window. Another world: the
        window is reduced as one global sum, so rank 0 carries all of the old ranks' part."""
        if len(ranks) == self.rt.env.world_size:
            saved = ranks[self.rt.env.rank].get("window")
        else:
            old = [r["window"] for r in ranks if r.get("window") is not None]
            saved = [sum(column) for column in zip(*old, strict=True)] if old and self.rt.is_main else None
        if saved is not None:  # None: a checkpoint written before windows were kept
            self.sums.copy_(torch.tensor(saved, dtype=self.sums.dtype))


def finite_or_null(value: Any) -> Any:
    """NaN and infinities as None: strict JSON parsers reject NaN (no eval set: no eval loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value
