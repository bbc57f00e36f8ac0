"""``make gpu-check``: everything CI cannot run, on a machine with NVIDIA GPUs, in one table.

1. the ``gpu``-marked tests (no host sync on a step that does not log, pinned batches, NVML);
2. short real runs of the training job in debug mode (1 GPU) and local mode (every GPU), with
   the transport NCCL chose between the GPUs (rank 0's ``nccl transport:`` line);
3. peak GPU memory of each memory option on one transformer (1024 wide, 8 layers, batch 64 of up
   to 512 rows): none, bf16, fp16, activation checkpointing, both, grad accumulation;
4. a resume: a run stopped at step 20 continued in place to step 40; and a transformer with
   dropout (which draws from the CUDA generator) stopped at step 15 and resumed ends with the
   weights of a run straight to step 30;
5. ``bench/train_bench.py --device cuda`` for mlp and transformer at batch 256 with 4 workers;
6. ``parallelism.strategy=fsdp`` on every GPU (bf16): a run, a resume, and ``bench/fsdp_bench.py
   --device cuda`` (model state and peak allocated per rank, ddp vs fsdp, 1024 wide, 8 layers);
7. ``task=causal_lm model=gpt`` on every GPU, bf16, under ddp and fsdp, on byte tokens of the
   Python standard library's sources: tokens/s, model TFLOP/s and MFU, eager and with
   ``model.compile=true``, on one GPU and on every GPU, the compile seconds and the optimizer's
   kernels (``optim.implementation=auto``: fused on CUDA), and each compiled run's losses beside
   the eager run's, window by window (a gap from the first window: the compiled code computes
   something else);
8. what the memory sampler (a thread in local rank 0's process) costs: one sample's time through
   NVML, and samples/s on every GPU with telemetry off, on at the default 5 s, and on every 0.5 s.

It needs only what a GPU node has: a python with torch, and the pure-Python packages from a local
folder (``make gpu-deps`` fills ``.gpu-deps`` where a package index is reachable; copy it over).

    PYTHONPATH=.gpu-deps:. python3 bench/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


STEPS = ("tests", "modes", "memory", "resume", "train_bench", "fsdp", "causal_lm", "telemetry")
LOSS_WINDOW_STEPS = 10  # causal_lm's log interval: the windows compare_losses sets side by side


class Check:
    def __init__(self, tmp: Path, out: Path | None = None) -> None:
        self.tmp = tmp
        self.out = out
        self.rows: list[tuple[str, str, str]] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1"}

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
    peaks = [r["end"]["max_allocated_bytes"] for r in summary["memory"]["ranks"] if r.get("end")]
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


def causal_lm(c: Check, gpus: int) -> None:
    sys.path.insert(0, str(ROOT))  # the node's python may have no install of this checkout
    from corpora import byte_corpus  # bench/, beside this file

    data = byte_corpus(c.tmp / "stdlib-bytes")
    # eager vs model.compile=true (inductor, per block), each with the fused AdamW that
    # optim.implementation=auto picks on CUDA; on one GPU and on all of them
    runs = [(strategy, compiled, n) for n in sorted({1, gpus}) for strategy in ("ddp", "fsdp")
            for compiled in (False, True)]
    eager_losses: list[float] | None = None  # the pair's eager run, for its compiled run
    for strategy, compiled, n in runs:
        check = f"causal_lm gpt {strategy} bf16 {'compiled' if compiled else 'eager'} on {n} GPU(s)"
        proc, summary, run_dir = c.train(
            check, "cluster=local", f"parallelism.gpus_per_node={n}", f"parallelism.strategy={strategy}",
            "task=causal_lm", "model=gpt", "model.d_model=768", "model.num_layers=12", "model.num_heads=12",
            "data.seq_len=1024", "data.batch_size=8", "memory.amp=bf16", f"data.path={data}",
            f"model.compile={str(compiled).lower()}",
            "optim.max_steps=100", f"log_every_steps={LOSS_WINDOW_STEPS}", "logger=jsonl")
        if summary is None:
            eager_losses = None  # no pair to compare
            c.failed(check, proc)
            continue
        windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if "tokens_per_s" in line]
        last = windows[-1]
        mfu = "null" if last["mfu"] is None else f"{100 * last['mfu']:.1f}%"
        # every window's rate (a slow one in the middle: a recompile, a checkpoint) and the
        # recompiles the run counted: a compiled run slower than eager names its cause here
        recompiles = (summary.get("compile") or {}).get("recompiles", 0)
        c.row(check, "ok" if len(set(summary["param_checksum_per_rank"])) == 1 else "FAILED",
              f"{last['tokens_per_s']:,.0f} tokens/s, {last['model_tflops_per_s']:.1f} model TFLOP/s, "
              f"MFU {mfu}, loss {summary['final_train_loss']:.3f}, peak {peak_gib(summary)}, "
              f"compile {summary['startup_s'].get('compile', 0):.0f} s, recompiles {recompiles}, "
              f"optimizer {summary['optim_implementation']}; windows (k tokens/s): "
              + " ".join(f"{w['tokens_per_s'] / 1000:,.0f}" for w in windows))
        losses = [w["train_loss"] for w in windows]
        if not compiled:
            eager_losses = losses
        elif eager_losses is not None:
            compare_losses(c, f"causal_lm gpt {strategy} bf16 compiled vs eager on {n} GPU(s)",
                           eager_losses, losses)


def compare_losses(c: Check, check: str, eager: list[float], compiled: list[float]) -> None:
    """The two runs' losses, window by window (same seed, same batches): a compiled model that
    computes what the eager one does starts on the eager losses and drifts from them only as bf16
    rounding compounds. On the CPU (a 2-layer gpt, byte tokens, 80 steps, windows of 10) inductor's
    windows stayed within 0.07 % of eager's in fp32 and 0.5 % in bf16, the first within 0.002 %:
    a gap in the first window is the compiled code's, not rounding."""
    gaps = [100 * (b / a - 1) for a, b in zip(eager, compiled, strict=False)]
    verdict = "ok" if gaps and abs(gaps[0]) < 1 and abs(gaps[-1]) < 3 else "DIFFERS"
    c.row(check, verdict, f"loss per {LOSS_WINDOW_STEPS} steps, eager / compiled (gap): "
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter benchmark (one repeat, 100 steps)")
    parser.add_argument("--only", default=",".join(STEPS), metavar="STEP,...",
                        help=f"the steps to run, in their order: {','.join(STEPS)} (default: all; the "
                             "whole check takes about 15 minutes on one H100, so split it across calls "
                             "where a call is limited)")
    parser.add_argument("--out", type=Path, help="a folder for the whole log of each failed check")
    args = parser.parse_args()
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
        "causal_lm": lambda c: causal_lm(c, gpus), "telemetry": lambda c: telemetry_cost(c, gpus)}
    with tempfile.TemporaryDirectory(prefix="switchyard-gpu-check-") as tmp:
        c = Check(Path(tmp), args.out)
        for name in STEPS:
            if name in args.only.split(","):
                started = time.perf_counter()
                steps[name](c)
                print(f"[gpu-check] step {name}: {time.perf_counter() - started:.0f} s", flush=True)
    print(f"\n{torch.cuda.get_device_name(0)} x {gpus}, torch {torch.__version__}\n")
    print("| check | result | detail |\n|---|---|---|")
    for check, result, detail in c.rows:
        print(f"| {check} | {result} | {detail} |")
    return 0 if all(result != "FAILED" for _, result, _ in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
