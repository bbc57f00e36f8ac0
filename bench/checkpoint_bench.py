"""How long the step loop waits for checkpoints: ``checkpoint.async_save=true`` against ``false``.

A transformer of about 25M parameters (``d_model=512``, 8 layers, ``ff_dim=2048``: 300 MB of
model and AdamW state per checkpoint) on 2 local CPU ranks, checkpointing every 10 steps. Each
mode runs ``--repeats`` times, alternating, each a fresh ``python -m jobs.train``; the figures are
``summary.json``'s ``checkpoint_blocking_s`` (the loop's waits, the final blocking save included)
and ``checkpoint_save_s`` (the saves' wall time). Target: async blocking <= 0.2x sync blocking.

    python bench/checkpoint_bench.py [--steps 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=transformer", "model.d_model=512", "model.num_layers=8", "model.ff_dim=2048",
         "model.num_heads=8", "data.batch_size=8", "data.demo_max_rows=16", "data.demo_num_samples=512"]


def run(tmp: Path, name: str, steps: int, async_save: bool) -> dict[str, float]:
    run_dir = tmp / name
    subprocess.run([sys.executable, "-m", "jobs.train", *MODEL, f"optim.max_steps={steps}",
                    "checkpoint.every_steps=10", f"checkpoint.async_save={str(async_save).lower()}",
                    "checkpoint.keep_last=2", "logger=jsonl", "telemetry.enabled=false",
                    f"data.cache_dir={tmp / 'cache'}", f"hydra.run.dir={run_dir}"],
                   capture_output=True, text=True, check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: float(summary[k]) for k in ("checkpoint_blocking_s", "checkpoint_save_s", "wall_s")} | \
        {"saves": summary["checkpoint_saves"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as tmp:
        for repeat in range(args.repeats):
            for mode in (False, True):
                results[mode].append(run(Path(tmp), f"{mode}-{repeat}", args.steps, mode))
                print(f"repeat {repeat} async_save={mode}: {results[mode][-1]}", flush=True)
    sync_blocking = statistics.median(r["checkpoint_blocking_s"] for r in results[False])
    print(f"\n| checkpoint.async_save | saves | blocking s (median of {args.repeats}) | save s | wall s | "
          f"blocking vs sync |\n|---|---|---|---|---|---|")
    for mode in (False, True):
        rows = results[mode]
        blocking = statistics.median(r["checkpoint_blocking_s"] for r in rows)
        print(f"| {str(mode).lower()} | {rows[0]['saves']:.0f} | {blocking:.2f} | "
              f"{statistics.median(r['checkpoint_save_s'] for r in rows):.2f} | "
              f"{statistics.median(r['wall_s'] for r in rows):.1f} | {blocking / sync_blocking:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
