"""``profile_steps=N``: a ``torch.profiler`` trace of N training steps, and where their time went.

The trace starts after the first log window (its steps hold the start-up: a compiled model's first
calls, the allocator's growth), after one warm-up step the profiler discards, so the window that
holds the profiled steps is slower than the others. Each rank writes ``RUN/profile/rank-N.trace.json``
(Chrome's trace format: chrome://tracing, Perfetto) and ``rank-N.kernels.json``: the profiler's key
averages, one row per kernel (GPU) or per operator's own time (CPU), and their time by class
(``KERNEL_CLASSES``) per step, both written when the loop ends (writing them at once would slow
the window being timed). Rank 0 prints the classes in one line.

Off (``profile_steps=0``, the default) nothing is created: the profiler costs nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from durable import atomic

KERNEL_CLASSES = ("matmul", "attention", "elementwise/norm", "optimizer", "communication", "memcpy", "other")

# First match wins: a collective before "reduce", the optimizer's fused kernels before elementwise,
# inductor's matmul templates (triton_tem_*) before its pointwise and reduction kernels (triton_*).
# Names as CUDA kernels (cuBLAS's sm90_xmma_gemm_*, nvjet_*, flash_fwd_kernel,
# multi_tensor_apply_kernel<FusedAdamMathFunctor>, ncclDevKernel_*, "Memcpy HtoD") and as the CPU
# operators a CPU run shows instead (aten::addmm, aten::_fused_adamw_, gloo:all_reduce).
_CLASS_PATTERNS = [
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|gloo|c10d::|send|recv"),
    # FSDP2's copies into and out of its all-gather buffers are copies too (CatArrayBatchedCopy,
    # split_with_sizes_copy); a dtype cast is an elementwise kernel
    ("memcpy", r"memcpy|memset|dtoh|htod|dtod|pin_memory|_to_copy|aten::copy_$|CatArrayBatchedCopy"
               r"|split_with_sizes_copy|chunk_cat"),
    ("optimizer", r"adam|\bsgd|fusedsgd|multi_tensor_apply|_foreach_|optimizer"),
    ("attention", r"flash|fmha|attention|sdpa|mha|softmax"),
    ("matmul", r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|aten::linear|cublas|cutlass|nvjet|xmma|wgmma"
               r"|s16816|triton_tem|extern_kernels"),
    ("elementwise/norm", r"elementwise|vectorized|norm|gelu|tanh|add|mul|div|sub|triton_|reduce|sum"
                         r"|mean|cast|copy|fill|zero|embedding|cross_entropy|nll|where|mask|clamp"
                         r"|index|cat|exp|log|pow|sqrt|neg|select|gather|scatter|arange|rand"),
]
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in _CLASS_PATTERNS]


def kernel_class(name: str) -> str:
    """The class of one kernel or CPU operator, by its name (``KERNEL_CLASSES``)."""
    for cls, pattern in _COMPILED:
        if pattern.search(name):
            return cls
    return "other"


def key_average_rows(prof: torch.profiler.profile) -> tuple[str, list[dict[str, Any]]]:
    """("cuda" or "cpu", rows of {name, us, calls}) from the profiler's key averages. A GPU run:
    the kernels' own device time (each kernel is its own row; an operator's device time is its
    kernels', so counting operators too would count it twice). A CPU run: each operator's self
    time (an operator's total holds its children's)."""
    averages = prof.key_averages()
    kernels = [(e.key, float(e.self_device_time_total), int(e.count)) for e in averages
               if e.device_type != torch.autograd.DeviceType.CPU and e.self_device_time_total > 0]
    device, rows = ("cuda", kernels) if kernels else \
        ("cpu", [(e.key, float(e.self_cpu_time_total), int(e.count)) for e in averages
                 if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep")])
    rows.sort(key=lambda row: -row[1])
    return device, [{"name": name, "us": us, "calls": calls} for name, us, calls in rows]


def time_by_class(rows: Iterable[dict[str, Any]], steps: int = 1) -> dict[str, float]:
    """Milliseconds per step of each class, every class present (0.0 where none ran)."""
    totals = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for row in rows:
        totals[kernel_class(row["name"])] += row["us"] / 1000 / max(steps, 1)
    return totals


def describe(classes: dict[str, float]) -> str:
    """``42.1 ms/step: matmul 61 % (25.7 ms), attention 12 % ...``, largest first, empty classes out."""
    total = sum(classes.values())
    if total <= 0:
        return "no time recorded"
    parts = [f"{cls} {100 * ms / total:.0f} % ({ms:.2f} ms)"
             for cls, ms in sorted(classes.items(), key=lambda item: -item[1]) if ms > 0]
    return f"{total:.2f} ms/step: " + ", ".join(parts)


def summary(prof: torch.profiler.profile, steps: int) -> dict[str, Any]:
    """What ``rank-N.kernels.json`` holds: the device, the steps, time by class, every row. The
    steps are those the trace holds (``ProfilerStep#N``, one per step), at most ``steps``: a run
    that ended before the schedule did is divided by what it traced."""
    device, rows = key_average_rows(prof)
    traced = sum(1 for e in prof.key_averages() if e.key.startswith("ProfilerStep#")) or steps
    steps = min(steps, traced)
    return {"device": device, "steps": steps, "ms_per_step_by_class": time_by_class(rows, steps),
            "rows": rows}


def write(prof: torch.profiler.profile, out: Path, name: str, steps: int) -> dict[str, Any]:
    """``out/<name>.trace.json`` and ``out/<name>.kernels.json``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"{name}.trace.json"))
    found = summary(prof, steps)
    with atomic.atomic_write(out / f"{name}.kernels.json") as f:
        f.write(json.dumps(found, indent=1))
    return found


def activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    found = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        found.append(torch.profiler.ProfilerActivity.CUDA)
    return found


class StepProfiler:
    """The trainer's profiler: ``step()`` after every optimizer step; traces ``steps`` steps after
    ``skip`` steps and one discarded warm-up step; ``close()`` (the loop's end) writes them."""

    def __init__(self, steps: int, skip: int, out: Path, rank: int, device: torch.device,
                 is_main: bool) -> None:
        self.steps, self.out, self.name, self.is_main = steps, out, f"rank-{rank}", is_main
        self.done = steps <= 0
        self.found: dict[str, Any] | None = None
        self.prof: torch.profiler.profile | None = None
        if not self.done:
            schedule = torch.profiler.schedule(skip_first=skip, wait=0, warmup=1, active=steps, repeat=1)
            self.prof = torch.profiler.profile(activities=activities(device), schedule=schedule,
                                               on_trace_ready=self.ready)
            self.prof.start()

    def ready(self, prof: torch.profiler.profile) -> None:
        self.done = True  # written at close: exporting now would slow the window being timed

    def step(self) -> None:
        if self.prof is None or self.done:
            return
        self.prof.step()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop, and write what was traced (all of it: a run shorter than the schedule is divided
        by the steps it traced)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        if not self.done:
            return  # the run ended before the first traced step: nothing to write
        self.found = write(prof, self.out, self.name, self.steps)
        if self.is_main:
            classes = describe(self.found["ms_per_step_by_class"])
            print(f"profile: {self.found['steps']} steps in {self.out}; {classes}", flush=True)
