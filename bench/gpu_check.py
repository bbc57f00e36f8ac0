"""``make gpu-check``: everything CI cannot run, on a machine with NVIDIA GPUs, in one table.

Its steps (``--only``), run in the order a short lease needs: what never ran on a GPU first, then
what ran longest ago (``bench/gpu_runs.json``, which ``--record`` or ``--out`` updates):

- ``causal_lm``: ``task=causal_lm model=gpt`` (768 wide, 12 layers, sequences of 1024, bf16) on one
  GPU beside ``bench/reference_gpt.py``, a hand-written nanoGPT-style loop of the same GPT on the
  same GPU, data and batches: eager and compiled (the reference compiles the whole model, as
  nanoGPT), batch 8 and 32, under ddp and fsdp. Each pair's ratio against issue 55's targets
  (Switchyard / reference, compiled / eager, fsdp / ddp), and their losses window by window (a
  gap from the first window: the two compute something else). ``--profile``: a torch.profiler
  trace of 5 steps of each run and its time by kernel class (``profile_steps``); with ``--out``
  every trace goes into ``profiles-N.tar.gz``. On every GPU too where there are several;
- ``leads``: each lead of issue 55 switched on beside the same run without it (batch 32, one GPU):
  dynamo's DDP optimizer off, the whole model compiled, fsdp without resharding after forward,
  CUDA graphs;
- ``tests``: the ``gpu``-marked tests (no host sync on a step that does not log, pinned batches, NVML);
- ``modes``: short real runs of the training job in debug mode (1 GPU) and local mode (every GPU),
  with the transport NCCL chose between the GPUs (rank 0's ``nccl transport:`` line);
- ``memory``: peak GPU memory of each memory option on one transformer (1024 wide, 8 layers, batch
  64 of up to 512 rows): none, bf16, fp16, activation checkpointing, both, grad accumulation;
- ``resume``: a run stopped at step 20 continued in place to step 40; and a transformer with
  dropout (which draws from the CUDA generator) stopped at step 15 and resumed ends with the
  weights of a run straight to step 30;
- ``fsdp``: ``parallelism.strategy=fsdp`` on every GPU (bf16): a run, a resume, and
  ``bench/fsdp_bench.py --device cuda`` (model state and peak allocated per rank, ddp vs fsdp);
- ``train_bench``: ``bench/train_bench.py --device cuda`` for mlp and transformer at batch 256;
- ``telemetry``: what the memory sampler (a thread in local rank 0's process) costs: one sample's
  time through NVML, and samples/s on every GPU with telemetry off, on at 5 s, and every 0.5 s.

``--budget-s S`` starts no run that may end past S seconds (a lent machine's call has a limit):
what does not fit is a "not reached" row, and its step stays "never ran". At the end the table is
printed as the dated section of docs/gpus.md (the GPU, driver, torch, date and commit):
``--record`` adds it to docs/gpus.md and bench/gpu_runs.json here, ``--out DIR`` writes both into
DIR (``gpus-section.md``, ``gpu_runs.json``) for a machine whose checkout is a copy.

It needs only what a GPU node has: a python with torch, and the pure-Python packages from a local
folder (``make gpu-deps`` fills ``.gpu-deps`` where a package index is reachable; copy it over).

    PYTHONPATH=.gpu-deps:. python3 bench/gpu_check.py [--quick] [--only causal_lm --profile --budget-s 500]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
BIG_TRANSFORMER = ["model=transformer", "model.d_model=1024", "model.num_layers=8", "model.ff_dim=4096",
                   "model.num_heads=16", "data.batch_size=64", "data.demo_max_rows=512",
                   "data.demo_num_samples=2048", "optim.max_steps=20", "telemetry.interval_s=1"]
MEMORY_OPTIONS = [
    ("memory.amp=none", []),
    ("memory.amp=bf16", ["memory.amp=bf16"]),
    ("memory.amp=fp16", ["memory.amp=fp16"]),
    ("activation checkpointing", ["memory.activation_checkpointing=true"]),
    ("bf16 + activation checkpointing", ["memory.amp=bf16", "memory.activation_checkpointing=true"]),
    ("grad_accum_steps=4, batch 16", ["optim.grad_accum_steps=4", "data.batch_size=16"]),
]


# The steps, in the order they run among those that ran before (or never ran: ``order_steps``).
STEPS = ("causal_lm", "leads", "tests", "modes", "memory", "resume", "fsdp", "train_bench", "telemetry")
LOSS_WINDOW_STEPS = 10  # causal_lm's log interval: the windows compare_losses sets side by side
STATE = ROOT / "bench" / "gpu_runs.json"  # when each step last ran on a GPU, and where
GPUS_PAGE = ROOT / "docs" / "gpus.md"
RUN_SECONDS = 60  # the longest one GPT run takes (a compile included): none starts with less left


class Check:
    def __init__(self, tmp: Path, out: Path | None = None, deadline: float = float("inf")) -> None:
        self.tmp = tmp
        self.out = out
        self.deadline = deadline  # time.monotonic() past which no run starts
        self.rows: list[tuple[str, str, str]] = []
        self.profiles: list[Path] = []  # each run's trace folder, packed into --out at the end
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1"}

    def time_for(self, check: str, seconds: float = RUN_SECONDS) -> bool:
        """Whether ``check`` fits the time left; a "not reached" row where it does not."""
        if time.monotonic() + seconds <= self.deadline:
            return True
        self.row(check, "not reached", f"less than {seconds:.0f} s left of --budget-s")
        return False

    def corpus(self) -> Path:
        """The GPT runs' data: byte tokens of the Python standard library's sources, made once."""
        sys.path.insert(0, str(ROOT))  # the node's python may have no install of this checkout
        from corpora import byte_corpus  # bench/, beside this file

        path = self.tmp / "stdlib-bytes"
        return path if path.exists() else byte_corpus(path)

    def keep_profile(self, check: str, folder: Path, name: str) -> dict[str, float] | None:
        """The run's profile (``profile_steps``): its time by kernel class, as a row; the trace is
        kept for --out."""
        found = folder / f"{name}.kernels.json"
        if not found.exists():
            return None
        sys.path.insert(0, str(ROOT))
        from orchestrator.training.profiling import describe

        kept = self.tmp / "profiles" / re.sub(r"\W+", "-", check)
        shutil.copytree(folder, kept, dirs_exist_ok=True)
        self.profiles.append(kept)
        classes: dict[str, float] = json.loads(found.read_text())["ms_per_step_by_class"]
        self.row(f"profile: {check}", "ok", describe(classes))
        return classes

    def row(self, check: str, result: str, detail: str) -> None:
        self.rows.append((check, result, detail))
        print(f"[gpu-check] {check}: {result} {detail}", flush=True)

    def run(self, args: list[str], timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=self.env, cwd=ROOT)

    def train(self, name: str, *overrides: str, run_dir: Path | None = None
              ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None, Path]:
        run_dir = run_dir or self.tmp / re.sub(r"\W+", "-", name)
        # logger=jsonl: a node's bare python has no tensorboard, and make gpu-deps brings none
        proc = self.run([sys.executable, "-m", "jobs.train", "parallelism=gpu", "logger=jsonl", *overrides,
                         f"data.cache_dir={self.tmp / 'cache'}", f"hydra.run.dir={run_dir}"])
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if proc.returncode == 0 and summary_path.exists() \
            else None
        return proc, summary, run_dir

    def keep(self, name: str, text: str) -> None:
        """A whole log into --out (where given): the table holds one line of it."""
        if self.out is not None:
            (self.out / re.sub(r"[^\w.-]+", "-", name)).write_text(text)

    def failed(self, check: str, proc: subprocess.CompletedProcess[str]) -> None:
        self.keep(f"{check}.log", proc.stdout + proc.stderr)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        self.row(check, "FAILED", f"exit {proc.returncode}: " + " / ".join(tail)[-300:])


def peak_gib(summary: dict[str, Any]) -> str:
    peaks = [r["end"]["max_allocated_bytes"] for r in summary["memory"]["ranks"]
             if "max_allocated_bytes" in (r.get("end") or {})]
    peaks = peaks or summary["peak_mem_bytes_per_rank"]  # a CPU run (gpu_check's own tests): RSS
    return ", ".join(f"{p / GIB:.2f}" for p in peaks) + " GiB"


def gpu_tests(c: Check) -> None:
    """The gpu-marked tests, less the two that start the training job: the steps below run it."""
    proc = c.run([sys.executable, "-m", "pytest", "-q", "-rf", "-m", "gpu", "tests/gpu",
                  "-p", "no:cacheprovider",
                  "-k", "not test_the_job_trains_on_the_gpu and not test_fsdp_trains_checkpoints"])
    c.keep("gpu-tests.log", proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines() or ["no output"]
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in lines if line.startswith("FAILED ")]
    c.row("gpu-marked tests", "ok" if proc.returncode == 0 else "FAILED",
          lines[-1] + ("; failed: " + ", ".join(failed) if failed else ""))


def modes(c: Check, gpus: int) -> None:
    for mode, count in (("debug", 1), ("local", gpus)):
        check = f"cluster={mode}, {count} GPU(s)"
        started = time.perf_counter()
        proc, summary, run_dir = c.train(check, f"cluster={mode}", f"parallelism.gpus_per_node={count}",
                                         "optim.max_steps=100")
        if summary is None:
            c.failed(check, proc)
            continue
        same = len(set(summary["param_checksum_per_rank"])) == 1
        flags = summary["memory"]["flags"]
        # rank 0's line from NCCL's own logs (RUN/nccl/rank-N.log): P2P or SHM between the GPUs
        transport = rank0_line(run_dir, proc, "nccl transport:") or "nccl transport: not reported"
        c.row(check, "ok" if same and (count == 1 or "not reported" not in transport) else "FAILED",
              f"world {summary['world_size']}, backend {summary['backend']}, loss "
              f"{summary['final_train_loss']:.3f}, peak {peak_gib(summary)}, replicas equal: {same}, "
              f"{time.perf_counter() - started:.0f} s; {transport}; "
              f"flags: {'; '.join(flags)[:200] or 'none'}")


def rank0_line(run_dir: Path, proc: subprocess.CompletedProcess[str], prefix: str) -> str | None:
    """The first line starting with ``prefix`` that rank 0 printed: in its own log (local mode keeps
    rank output out of the terminal), or on the terminal (debug mode)."""
    texts = [log.read_text(errors="replace") for log in run_dir.rglob("*_0_log.out")] + [proc.stdout]
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip().startswith(prefix)]
    return lines[0] if lines else None


def estimate_vs_peak(summary: dict[str, Any]) -> str:
    """The estimate made before submission beside the measured peak: an estimate more than a few
    percent under the peak would pass a job that does not fit."""
    found = (summary.get("memory_estimate") or {}).get("estimate_bytes") or {}
    peaks = [r["end"]["max_allocated_bytes"] for r in summary["memory"]["ranks"] if r.get("end")]
    if not found.get("peak") or not peaks:
        return "no estimate"
    return f"estimate {found['peak'] / GIB:.2f} GiB = {found['peak'] / max(peaks):.2f} x measured"


def memory_options(c: Check) -> None:
    for name, overrides in MEMORY_OPTIONS:
        proc, summary, _ = c.train(f"memory {name}", "cluster=local", "parallelism.gpus_per_node=1",
                                   *BIG_TRANSFORMER, *overrides)
        if summary is None:
            c.failed(f"memory: {name}", proc)
        else:
            c.row(f"memory: {name}", "ok", f"peak {peak_gib(summary)} (max_memory_allocated); "
                  f"{estimate_vs_peak(summary)}")


def resume(c: Check) -> None:
    common = ["cluster=local", "parallelism.gpus_per_node=1", "checkpoint.every_steps=10"]
    first, _, run_dir = c.train("resume", *common, "optim.max_steps=20")
    if first.returncode != 0:
        return c.failed("resume in place", first)
    again, summary, _ = c.train("resume", *common, "optim.max_steps=40", run_dir=run_dir)
    # rank 0 says so in its own log (local mode keeps rank output out of the terminal)
    resumed = any("resumed from" in log.read_text(errors="replace") for log in run_dir.rglob("*_0_log.out"))
    if summary is None:
        return c.failed("resume in place", again)
    c.row("resume in place", "ok" if resumed and summary["steps"] == 40 else "FAILED",
          f"resumed: {resumed}, steps {summary['steps']}")
    dropout_resume(c)


def dropout_resume(c: Check) -> None:
    """Dropout draws from the CUDA generator: a run stopped at step 15 and continued to 30 ends with
    the weights of a run straight to 30 only if each rank's CUDA RNG state is checkpointed."""
    common = ["cluster=local", "parallelism.gpus_per_node=1", "model=transformer", "model.dropout=0.1",
              "deterministic=true", "checkpoint.every_steps=5"]
    _, straight, _ = c.train("dropout straight", *common, "optim.max_steps=30")
    first, _, run_dir = c.train("dropout resumed", *common, "optim.max_steps=15")
    _, resumed, _ = c.train("dropout resumed", *common, "optim.max_steps=30", run_dir=run_dir)
    if straight is None or resumed is None:
        return c.failed("dropout resume bit-identical", first)
    same = straight["param_checksum_per_rank"] == resumed["param_checksum_per_rank"]
    c.row("dropout resume bit-identical", "ok" if same else "FAILED",
          f"weights at step 30: straight {straight['param_checksum_per_rank'][0]}, stopped at 15 and "
          f"resumed {resumed['param_checksum_per_rank'][0]}")


def train_bench(c: Check, quick: bool) -> None:
    for model in ("mlp", "transformer"):
        extra = ["--d-model", "256", "--layers", "4"] if model == "transformer" else []
        proc = c.run([sys.executable, "bench/train_bench.py", "--device", "cuda", "--world", "1",
                      "--batch-size", "256", "--workers", "4", "--model", model,
                      "--steps", "100" if quick else "300", "--repeats", "1" if quick else "2", *extra])
        if proc.returncode != 0:
            c.failed(f"train_bench {model}", proc)
            continue
        table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
        c.row(f"train_bench {model}, batch 256, 4 workers", "ok", " ".join(table[2:]))


def fsdp(c: Check, gpus: int) -> None:
    common = ["cluster=local", f"parallelism.gpus_per_node={gpus}", "parallelism.strategy=fsdp",
              "memory.amp=bf16", "checkpoint.every_steps=10"]
    first, _, run_dir = c.train("fsdp", *common, "optim.max_steps=20")
    if first.returncode != 0:
        return c.failed("fsdp run", first)
    shards = len(list((run_dir / "checkpoints" / "step-000000020.dcp").glob("*.distcp")))
    again, summary, _ = c.train("fsdp", *common, "optim.max_steps=30", run_dir=run_dir)
    if summary is None:
        return c.failed("fsdp resume", again)
    good = summary["steps"] == 30 and summary["resumed_from"] is not None and shards == gpus
    c.row(f"fsdp on {gpus} GPU(s), bf16", "ok" if good else "FAILED",
          f"{shards} shards at step 20, resumed_from {summary['resumed_from']}, peak {peak_gib(summary)}")
    worlds = [str(w) for w in (1, 2, 4, 8) if w <= gpus]
    proc = c.run([sys.executable, "bench/fsdp_bench.py", "--device", "cuda", "--d-model", "1024",
                  "--layers", "8", "--worlds", *worlds])
    if proc.returncode != 0:
        return c.failed("fsdp_bench", proc)
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    c.row("fsdp_bench, 1024 wide, 8 layers", "ok", " ".join(table[2:]))


LM_STEPS = {8: 100, 32: 60}  # steps per run by batch: 10-step windows, the first one start-up
LM_MODEL = {"d_model": 768, "layers": 12, "heads": 12, "seq_len": 1024}  # GPT-2 small's shape
LM_TARGETS = {"vs reference": 0.95, "compiled / eager, ddp": 1.3, "compiled / eager, fsdp": 1.0,
              "fsdp / ddp": 0.8}
PROFILE_STEPS = 5


@dataclass
class LmRun:
    """One GPT run's figures, from Switchyard's metrics.jsonl or the reference's JSON."""

    rates: list[float]  # tokens/s of each window
    losses: list[float]  # mean loss of each window
    detail: str = ""
    mfu: float | None = None  # of the steady rate (Switchyard's; the reference's by proportion)
    classes: dict[str, float] | None = None  # the profile's ms per step by kernel class

    @property
    def steady(self) -> float:
        """The median window after the first (start-up, a compile): the same on both sides."""
        later = self.rates[1:] or self.rates
        return float(statistics.median(later)) if later else 0.0


def lm_overrides(data: Path, batch: int, strategy: str, compiled: bool, gpus: int, profile: bool,
                 *extra: str) -> list[str]:
    shape = LM_MODEL
    return ["cluster=local", f"parallelism.gpus_per_node={gpus}", "parallelism.procs_per_node=1",
            f"parallelism.strategy={strategy}", "task=causal_lm", "model=gpt",
            f"model.d_model={shape['d_model']}", f"model.num_layers={shape['layers']}",
            f"model.num_heads={shape['heads']}", f"data.seq_len={shape['seq_len']}",
            f"data.batch_size={batch}", "memory.amp=bf16", f"data.path={data}",
            f"model.compile={str(compiled).lower()}", f"optim.max_steps={LM_STEPS[batch]}",
            f"log_every_steps={LOSS_WINDOW_STEPS}", "checkpoint.every_steps=0",
            f"profile_steps={PROFILE_STEPS if profile else 0}", *extra]


def switchyard_lm(c: Check, check: str, overrides: list[str]) -> LmRun | None:
    """``jobs.train`` with ``overrides``; a FAILED row (and None) when it fails."""
    if not c.time_for(check):
        return None
    proc, summary, run_dir = c.train(check, *overrides)
    if summary is None:
        c.failed(check, proc)
        return None
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "tokens_per_s" in line]
    recompiles = (summary.get("compile") or {}).get("recompiles", 0)
    run = LmRun([w["tokens_per_s"] for w in windows], [w["train_loss"] for w in windows])
    last = windows[-1]
    run.mfu = None if last["mfu"] is None else last["mfu"] * run.steady / last["tokens_per_s"]
    compile_s = summary["startup_s"].get("compile", 0)
    run.detail = (f"{run.steady:,.0f} tokens/s ({percent(run.mfu)} MFU), loss "
                  f"{summary['final_train_loss']:.3f}, peak {peak_gib(summary)}, compile {compile_s:.0f} s, "
                  f"recompiles {recompiles}, optimizer {summary['optim_implementation']}; windows "
                  f"(k tokens/s): " + " ".join(f"{rate / 1000:,.0f}" for rate in run.rates))
    good = len(set(summary["param_checksum_per_rank"])) == 1
    c.row(check, "ok" if good else "FAILED", run.detail)
    run.classes = c.keep_profile(check, run_dir / "profile", "rank-0")
    return run


def reference_lm(c: Check, check: str, data: Path, batch: int, compiled: bool, profile: bool) -> LmRun | None:
    """``bench/reference_gpt.py``, the hand-written loop, in its own process on cuda:0."""
    if not c.time_for(check):
        return None
    out = c.tmp / re.sub(r"\W+", "-", check)
    shape = [f"--{key.replace('_', '-')}={value}" for key, value in LM_MODEL.items()]
    proc = c.run([sys.executable, "bench/reference_gpt.py", "--data", str(data), "--batch", str(batch),
                  *shape,
                  "--steps", str(LM_STEPS[batch]), "--log-every", str(LOSS_WINDOW_STEPS),
                  "--profile-steps", str(PROFILE_STEPS), *(["--compile"] if compiled else []),
                  *(["--profile", str(out)] if profile else [])])
    if proc.returncode != 0:
        c.failed(check, proc)
        return None
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    run = LmRun(found["tokens_per_s"], found["losses"])
    run.detail = (f"{run.steady:,.0f} tokens/s, loss {found['losses'][-1]:.3f}, peak "
                  f"{found['peak_bytes'] / GIB:.2f} GiB, first step {found['first_step_s']:.0f} s; windows "
                  f"(k tokens/s): " + " ".join(f"{rate / 1000:,.0f}" for rate in run.rates))
    c.row(check, "ok", run.detail)
    run.classes = c.keep_profile(check, out, "reference") if profile else None
    return run


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def side_by_side(c: Check, check: str, ours: LmRun | None, base: LmRun | None, target: float) -> None:
    """One ratio row: ``ours`` over ``base`` (steady tokens/s), against the issue's target."""
    if ours is None or base is None:
        return c.row(check, "not reached", "a run of the pair failed or did not fit the budget")
    ratio = ours.steady / base.steady if base.steady else 0.0
    mfu = f"; MFU {percent(ours.mfu)}" if ours.mfu is not None else ""
    c.row(check, "ok" if ratio >= target else "BELOW", f"{ratio:.2f}x (target {target:.2f}x): "
          f"{ours.steady:,.0f} / {base.steady:,.0f} tokens/s{mfu}")


def causal_lm(c: Check, gpus: int, profile: bool) -> None:
    """``task=causal_lm model=gpt`` (768 wide, 12 layers, sequences of 1024, bf16) on one GPU,
    beside the hand-written reference (``bench/reference_gpt.py``) on the same GPU, data and
    batches: eager and compiled, batch 8 (the earlier tables') and 32 (an H100's fill), under ddp
    and fsdp; each pair's ratio against the issue's target, and the losses side by side."""
    data = c.corpus()
    runs: dict[tuple[int, str, bool], LmRun | None] = {}
    # the pairs first (what a budget cut must not lose), then fsdp, then the ratios between them
    for batch in LM_STEPS:
        for compiled in (False, True):
            kind = "compiled" if compiled else "eager"
            ours = switchyard_lm(c, f"gpt b{batch} ddp {kind}",
                                 lm_overrides(data, batch, "ddp", compiled, 1, profile))
            base = reference_lm(c, f"gpt b{batch} reference {kind}", data, batch, compiled, profile)
            side_by_side(c, f"gpt b{batch} {kind}: switchyard ddp / reference", ours, base,
                         LM_TARGETS["vs reference"])
            if ours is not None and base is not None:
                compare_losses(c, f"gpt b{batch} {kind}: reference vs switchyard losses", base.losses,
                               ours.losses, ("reference", "switchyard"))
            runs[batch, "ddp", compiled] = ours
    for batch in LM_STEPS:
        for compiled in (False, True):
            kind = "compiled" if compiled else "eager"
            runs[batch, "fsdp", compiled] = switchyard_lm(
                c, f"gpt b{batch} fsdp {kind}", lm_overrides(data, batch, "fsdp", compiled, 1, profile))
            side_by_side(c, f"gpt b{batch} {kind}: fsdp / ddp", runs[batch, "fsdp", compiled],
                         runs[batch, "ddp", compiled], LM_TARGETS["fsdp / ddp"])
    for batch in LM_STEPS:
        for strategy in ("ddp", "fsdp"):
            eager, compiled_run = runs[batch, strategy, False], runs[batch, strategy, True]
            side_by_side(c, f"gpt b{batch} {strategy}: compiled / eager", compiled_run, eager,
                         LM_TARGETS[f"compiled / eager, {strategy}"])
            if eager is not None and compiled_run is not None:
                compare_losses(c, f"gpt b{batch} {strategy}: eager vs compiled losses", eager.losses,
                               compiled_run.losses)
        ddp, fsdp = runs[batch, "ddp", False], runs[batch, "fsdp", False]
        if ddp is not None and fsdp is not None:
            compare_losses(c, f"gpt b{batch} eager: ddp vs fsdp losses", ddp.losses, fsdp.losses,
                           ("ddp", "fsdp"))
    if gpus > 1:  # every GPU: Switchyard alone (the reference is one process on one GPU)
        for strategy in ("ddp", "fsdp"):
            for compiled in (False, True):
                switchyard_lm(c, f"gpt b8 {strategy} {'compiled' if compiled else 'eager'} on {gpus} GPUs",
                              lm_overrides(data, 8, strategy, compiled, gpus, False))


# Each lead of issue 55 as overrides, beside the run it changes (measured in the same call):
# (name, strategy, compiled, the overrides that switch the lead)
NO_RESHARD = "parallelism.fsdp_reshard_after_forward=false"
LEADS = [  # the likeliest first: a --budget-s cut drops the last
    ("ddp compiled, dynamo's DDP optimizer off", "ddp", True, ["model.compile_optimize_ddp=false"]),
    ("ddp compiled, the whole model", "ddp", True, ["model.compile_scope=model"]),
    ("fsdp eager, no reshard after forward", "fsdp", False, [NO_RESHARD]),
    ("ddp compiled, the whole model, DDP optimizer off", "ddp", True,
     ["model.compile_scope=model", "model.compile_optimize_ddp=false"]),
    ("fsdp compiled, no reshard after forward", "fsdp", True, [NO_RESHARD]),
    ("ddp compiled, CUDA graphs (reduce-overhead)", "ddp", True, ["model.compile_mode=reduce-overhead"]),
]


def leads(c: Check, batch: int = 32) -> None:
    """Each lead switched on, beside the same run without it, in one call: the ratio says what it
    is worth on this GPU (batch 32, one GPU)."""
    data = c.corpus()
    baselines: dict[tuple[str, bool], LmRun | None] = {}
    for name, strategy, compiled, extra in LEADS:
        key = (strategy, compiled)
        if key not in baselines:
            kind = "compiled" if compiled else "eager"
            baselines[key] = switchyard_lm(c, f"lead baseline: gpt b{batch} {strategy} {kind}",
                                           lm_overrides(data, batch, strategy, compiled, 1, False))
        run = switchyard_lm(c, f"lead: gpt b{batch} {name}",
                            lm_overrides(data, batch, strategy, compiled, 1, False, *extra))
        side_by_side(c, f"lead: {name} / without", run, baselines[key], 1.0)


def compare_losses(c: Check, check: str, eager: list[float], compiled: list[float],
                   names: tuple[str, str] = ("eager", "compiled")) -> None:
    """The two runs' losses, window by window (same seed, same batches): a compiled model that
    computes what the eager one does starts on the eager losses and drifts from them only as bf16
    rounding compounds. On the CPU (a 2-layer gpt, byte tokens, 80 steps, windows of 10) inductor's
    windows stayed within 0.07 % of eager's in fp32 and 0.5 % in bf16, the first within 0.002 %:
    a gap in the first window is the compiled code's, not rounding. The same holds for any two
    runs that should compute the same thing (``names``: Switchyard and the reference)."""
    gaps = [100 * (b / a - 1) for a, b in zip(eager, compiled, strict=False)]
    verdict = "ok" if gaps and abs(gaps[0]) < 1 and abs(gaps[-1]) < 3 else "DIFFERS"
    c.row(check, verdict, f"loss per {LOSS_WINDOW_STEPS} steps, {names[0]} / {names[1]} (gap): "
          + ", ".join(f"{a:.3f}/{b:.3f} ({g:+.1f}%)" for a, b, g in zip(eager, compiled, gaps, strict=False)))


def telemetry_cost(c: Check, gpus: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT))  # the node's python may have no install of this checkout
    from orchestrator.telemetry.sampler import MemorySampler

    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(gpus)]
    sampler = MemorySampler(c.tmp / "sampler-cost", "here", cuda_uuids=uuids)
    if not sampler.is_gpu:
        return c.row("telemetry cost", "FAILED", "the sampler found no GPU through NVML")
    sampler.sample_once()  # the first opens the file and the GPUs' handles
    started = time.perf_counter()
    for _ in range(20):
        sampler.sample_once()
    sample_ms = (time.perf_counter() - started) / 20 * 1000
    sampler.stop()
    rates: dict[str, float] = {}
    for name, overrides in (("off", ["telemetry.enabled=false"]), ("every 5 s", []),
                            ("every 0.5 s", ["telemetry.interval_s=0.5"])):
        proc, summary, run_dir = c.train(f"telemetry {name}", "cluster=local",
                                         f"parallelism.gpus_per_node={gpus}", "model=transformer",
                                         "data.batch_size=64", "optim.max_steps=400", "log_every_steps=50",
                                         *overrides)
        if summary is None:
            return c.failed(f"telemetry cost ({name})", proc)
        per_window = [json.loads(line)["samples_per_s"] for line in (run_dir / "metrics.jsonl").read_text()
                      .splitlines() if "samples_per_s" in line][1:]  # the first window holds start-up
        rates[name] = sorted(per_window)[len(per_window) // 2]
    off = rates["off"]
    c.row(f"telemetry cost, {gpus} GPU(s)", "ok",
          f"one sample {sample_ms:.1f} ms; samples/s (median of windows): " +
          ", ".join(f"{name} {rate:,.0f} ({100 * (rate / off - 1):+.1f}%)" for name, rate in rates.items()))


def order_steps(selected: list[str], state: dict[str, Any]) -> list[str]:
    """``selected`` in the order a short lease needs: what never ran on a GPU first, then what ran
    longest ago; ties in ``STEPS``' order (the GPT comparison first)."""
    ran = state.get("steps", {})
    return sorted(selected, key=lambda step: (step in ran, ran.get(step, {}).get("date", ""),
                                              STEPS.index(step)))


def load_state(path: Path = STATE) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"steps": {}}


def machine(gpus: int) -> dict[str, Any]:
    """What the dated table names: the GPU, its memory, the driver, python, torch, the commit."""
    import torch

    driver = "unknown"
    with contextlib.suppress(OSError, IndexError, subprocess.SubprocessError):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split()[0]
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpus": gpus, "memory_mib": props.total_memory >> 20, "driver": driver,
            "python": platform.python_version(), "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0))}


def render_table(results: dict[str, Any]) -> str:
    """The dated section docs/gpus.md gets from one gpu_check call: the machine, the command, the
    commit, then every row as the terminal printed it."""
    m = results["machine"]
    lines = [f"## What ran on {m['gpu']} x {m['gpus']} ({results['date']}, gpu_check)", "",
             f"{m['gpus']} x {m['gpu']} ({m['memory_mib']:,} MiB), driver {m['driver']}, Python "
             f"{m['python']}, torch {m['torch']}, {m['cores']} cores; `{results['command']}` at commit "
             f"{results['commit']}; steps (s): "
             + ", ".join(f"{name} {seconds:.0f}" for name, seconds in results["steps"].items()) + ".", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {check} | {result} | {detail.replace('|', '/')} |"
              for check, result, detail in results["rows"]]
    return "\n".join(lines) + "\n"


def insert_section(page: str, section: str) -> str:
    """``section`` above the page's newest "## What ran on" section (newest first), else at its end."""
    at = page.find("\n## What ran on ")
    if at < 0:
        return page.rstrip("\n") + "\n\n" + section
    return page[:at + 1] + section + "\n" + page[at + 1:]


def record(results: dict[str, Any], state: dict[str, Any], out: Path | None, write_here: bool) -> None:
    """The steps that ran into the state file, the table into docs/gpus.md (``write_here``: this
    checkout is kept), and both into ``out`` (a lent machine's copy is not)."""
    for name in results["steps"]:
        state.setdefault("steps", {})[name] = {"date": results["date"], "gpu": results["machine"]["gpu"],
                                               "commit": results["commit"]}
    section = render_table(results)
    if write_here:
        STATE.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        GPUS_PAGE.write_text(insert_section(GPUS_PAGE.read_text(), section))
    if out is not None:
        (out / "gpu_runs.json").write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        (out / "gpus-section.md").write_text(section)


def commit_of() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


PACK_BYTES = 8 << 20  # one more run's trace after this stays under the 16 MiB a lent machine hands back
PACKS = 4  # and few of them


def pack_profiles(c: Check) -> None:
    """Every run's trace into --out, as archives of about ``PACK_BYTES`` each (a lent machine hands
    back few files, none over 16 MiB), at most ``PACKS``; a row names what did not fit."""
    if c.out is None or not c.profiles:
        return
    left = list(c.profiles)
    for number in range(1, PACKS + 1):
        if not left:
            return
        path = c.out / f"profiles-{number}.tar.gz"
        with open(path, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            while left and (raw.tell() < PACK_BYTES or not tar.getmembers()):
                folder = left.pop(0)
                tar.add(folder, arcname=folder.name)
    if left:
        c.row("profiles kept", "partly", "not packed into --out (too large): "
              + ", ".join(folder.name for folder in left))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter benchmark (one repeat, 100 steps)")
    parser.add_argument("--only", default=",".join(STEPS), metavar="STEP,...",
                        help=f"the steps to run: {','.join(STEPS)} (default: all), what never ran on a "
                             "GPU first, then what ran longest ago (bench/gpu_runs.json)")
    parser.add_argument("--out", type=Path, help="a folder for the logs of failed checks, the profiles, "
                                                 "the state file and the docs section")
    parser.add_argument("--profile", action="store_true",
                        help=f"a torch.profiler trace of {PROFILE_STEPS} steps of each GPT run, and its "
                             "time by kernel class")
    parser.add_argument("--budget-s", type=float, help="start no run that may end past this many seconds")
    parser.add_argument("--record", action="store_true",
                        help="update bench/gpu_runs.json and add the dated table to docs/gpus.md")
    parser.add_argument("--commit", default=None, help="the commit to name (default: git's HEAD)")
    args = parser.parse_args()
    started = time.monotonic()
    unknown = sorted(set(args.only.split(",")) - set(STEPS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown step; choose from {','.join(STEPS)}")
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; run it on a GPU node", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    steps: dict[str, Callable[[Check], None]] = {
        "tests": gpu_tests, "modes": lambda c: modes(c, gpus), "memory": memory_options, "resume": resume,
        "train_bench": lambda c: train_bench(c, args.quick), "fsdp": lambda c: fsdp(c, gpus),
        "causal_lm": lambda c: causal_lm(c, gpus, args.profile), "leads": leads,
        "telemetry": lambda c: telemetry_cost(c, gpus)}
    state = load_state()
    ran: dict[str, float] = {}
    deadline = started + args.budget_s if args.budget_s else float("inf")
    with tempfile.TemporaryDirectory(prefix="switchyard-gpu-check-") as tmp:
        c = Check(Path(tmp), args.out, deadline)
        for name in order_steps(args.only.split(","), state):
            if not c.time_for(f"step {name}"):
                continue
            step_started, first_row = time.perf_counter(), len(c.rows)
            steps[name](c)
            seconds = time.perf_counter() - step_started
            print(f"[gpu-check] step {name}: {seconds:.0f} s", flush=True)
            if all(result != "not reached" for _, result, _ in c.rows[first_row:]):
                ran[name] = seconds  # a step cut short by the budget still counts as never run
        pack_profiles(c)
    results = {"date": datetime.date.today().isoformat(), "machine": machine(gpus), "rows": c.rows,
               "commit": args.commit or commit_of(), "steps": ran,
               "command": "bench/gpu_check.py " + " ".join(sys.argv[1:])}
    section = render_table(results)
    print("\n" + section)
    if args.record or args.out is not None:
        record(results, state, args.out, args.record)
    return 0 if all(result != "FAILED" for _, result, _ in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
