"""What ``model.compile=true`` costs and gains: tokens/s compiled vs eager, the compile phase cold
vs warm (a resume that loads the run directory's compile cache), final loss compiled vs eager.

Three ``python -m jobs.train cluster=debug task=causal_lm model=gpt`` runs on the same byte tokens:

1. eager, ``--steps`` steps;
2. compiled (inductor, per block), ``--steps`` steps, with an empty inductor cache of its own
   (``TORCHINDUCTOR_CACHE_DIR``): the cold compile;
3. run 2 resumed in place to ``2 x --steps``, with another empty inductor cache: all it can reuse
   is what run 2 published into its run directory (``RUN/compile_cache``): the warm compile.

tokens/s: the mean over ``metrics.jsonl``'s windows after the first (start-up excluded). The
compile seconds: ``startup_s.compile`` of ``summary.json``. Final loss: runs 1 and 2 at the same
step. They are not bit-equal: inductor fuses kernels and sums in another order, so each step
differs in the last float32 bits and training amplifies that; ``--loss-rtol`` (default 1%) is far
above that drift and far below what a wrong graph gives (a loss that does not fall).

    python bench/compile_bench.py [--steps 60] [--layers 4] [--d-model 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from corpora import byte_corpus  # bench/, beside this file

ROOT = Path(__file__).resolve().parents[1]


def train(args: argparse.Namespace, data: Path, run_dir: Path, steps: int, compiled: bool,
          inductor_cache: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "cluster=debug", "task=causal_lm", "model=gpt",
         f"data.path={data}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
         f"model.d_model={args.d_model}", f"model.num_layers={args.layers}", "model.num_heads=4",
         f"model.compile={str(compiled).lower()}", "optim.lr=1e-3", f"optim.max_steps={steps}",
         f"log_every_steps={args.log}", "logger=jsonl", "telemetry.enabled=false", "memory.estimate=off",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})
    if proc.returncode:
        sys.exit(f"error: the run in {run_dir} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "tokens_per_s" in line]
    first_step = steps // 2 if summary.get("resumed_from") else 0  # this attempt's windows only
    rates = [w["tokens_per_s"] for w in windows if w["step"] > first_step][1:]
    summary["bench_tokens_per_s"] = sum(rates) / len(rates) if rates else float("nan")
    return dict(summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loss-rtol", type=float, default=0.01)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data = byte_corpus(tmp / "stdlib")
        eager = train(args, data, tmp / "eager", args.steps, False, tmp / "inductor-eager")
        cold = train(args, data, tmp / "compiled", args.steps, True, tmp / "inductor-cold")
        warm = train(args, data, tmp / "compiled", 2 * args.steps, True, tmp / "inductor-warm")
    cold_s, warm_s = cold["startup_s"]["compile"], warm["startup_s"]["compile"]
    loss_e, loss_c = eager["final_train_loss"], cold["final_train_loss"]
    rel = abs(loss_c - loss_e) / abs(loss_e)
    print("| run | tokens/s | compile s | cache | final loss |\n|---|---|---|---|---|")
    print(f"| eager | {eager['bench_tokens_per_s']:,.0f} | - | - | {loss_e:.4f} |")
    print(f"| compiled, cold | {cold['bench_tokens_per_s']:,.0f} | {cold_s:.1f} | "
          f"{cold['compile']['cache']} | {loss_c:.4f} |")
    print(f"| compiled, resumed (warm) | {warm['bench_tokens_per_s']:,.0f} | {warm_s:.1f} | "
          f"{warm['compile']['cache']} | {warm['final_train_loss']:.4f} (step {2 * args.steps}) |")
    print(f"\nwarm/cold compile: {warm_s / cold_s:.2f}x; compiled/eager tokens/s: "
          f"{cold['bench_tokens_per_s'] / eager['bench_tokens_per_s']:.2f}x; final loss differs by "
          f"{rel:.2%} (tolerance {args.loss_rtol:.0%})")
    print(f"GPT d_model={args.d_model}, {args.layers} layers, seq_len {args.seq_len}, batch {args.batch}, "
          f"{args.steps} steps, AdamW ({eager['optim_implementation']}), fp32, cluster=debug")
    return 0 if rel <= args.loss_rtol else 1


if __name__ == "__main__":
    sys.exit(main())
