"""How long the step loop waits for checkpoints: ``checkpoint.async_save=true`` against ``false``.

A transformer of about 25M parameters (``d_model=512``, 8 layers, ``ff_dim=2048``: 300 MB of
model and AdamW state per checkpoint) on 2 local CPU ranks, checkpointing every 10 steps. Each
mode runs ``--repeats`` times, alternating, each a fresh ``python -m jobs.train``; the figures are
``summary.json``'s ``checkpoint_blocking_s`` (the loop's waits, the final blocking save included)
and ``checkpoint_save_s`` (the saves' wall time). Target: async blocking <= 0.2x sync blocking.

``--resume``: then the seconds a resume costs. The last run is continued for one more step, each
repeat a fresh process; ``summary.json``'s ``resume_s`` (a rank's process start -> its first step,
the checkpoint found, verified and loaded) against a plain ``torch.load`` of the same file in a
fresh process, timed the same way (from the kernel's record of the process start, so the
interpreter and the import of torch count). Target: at most 1.2x. Rank 0's ``startup_s`` shows
where the rest went.

    python bench/checkpoint_bench.py [--steps 100] [--repeats 3] [--resume]
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


PLAIN_LOAD = """
import sys, time, torch
from orchestrator.training.startup import process_start_time
torch.load(sys.argv[1], map_location="cpu", weights_only=False)
print(time.time() - process_start_time())
"""


def resume(tmp: Path, run_name: str, steps: int, repeats: int) -> None:
    """Continue ``run_name`` by one step ``repeats`` times (each from the same checkpoint: the
    one-step run's own final save is removed), against a plain load of that checkpoint."""
    run_dir = tmp / run_name
    newest = max((run_dir / "checkpoints").glob("step-*.pt"))
    ours, plain, phases = [], [], []
    for repeat in range(repeats):
        for saved in (run_dir / "checkpoints").glob("step-*.pt"):
            if saved != newest:
                saved.unlink()
        subprocess.run([sys.executable, "-m", "jobs.train", *MODEL, f"optim.max_steps={steps + 1}",
                        "checkpoint.every_steps=10", "checkpoint.keep_last=5", "logger=jsonl",
                        "telemetry.enabled=false", f"data.cache_dir={tmp / 'cache'}",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, check=True, cwd=ROOT)
        summary = json.loads((run_dir / "summary.json").read_text())
        ours.append(float(summary["resume_s"]))
        phases.append(summary.get("startup_s", {}))
        loaded = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(newest)], capture_output=True,
                                text=True, check=True)
        plain.append(float(loaded.stdout))
        print(f"resume {repeat}: resume_s {ours[-1]:.2f}, plain torch.load {plain[-1]:.2f}", flush=True)
    print(f"\nresume_s {statistics.median(ours):.2f} s vs plain torch.load {statistics.median(plain):.2f} s "
          f"(medians of {repeats}, {newest.stat().st_size / 2**20:.0f} MiB): "
          f"{statistics.median(ours) / statistics.median(plain):.2f}x")
    print("rank 0 start-up (median s): " + ", ".join(
        f"{name} {statistics.median(p.get(name, 0.0) for p in phases):.2f}" for name in phases[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="then measure resume_s (see above)")
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="checkpoint-bench-") as tmp:
        for repeat in range(args.repeats):
            for mode in (False, True):
                results[mode].append(run(Path(tmp), f"{mode}-{repeat}", args.steps, mode))
                print(f"repeat {repeat} async_save={mode}: {results[mode][-1]}", flush=True)
        report(results, args.repeats)
        if args.resume:
            resume(Path(tmp), f"False-{args.repeats - 1}", args.steps, args.repeats)
    return 0


def report(results: dict[bool, list[dict[str, float]]], repeats: int) -> None:
    sync_blocking = statistics.median(r["checkpoint_blocking_s"] for r in results[False])
    print(f"\n| checkpoint.async_save | saves | blocking s (median of {repeats}) | save s | wall s | "
          f"blocking vs sync |\n|---|---|---|---|---|---|")
    for mode in (False, True):
        rows = results[mode]
        blocking = statistics.median(r["checkpoint_blocking_s"] for r in rows)
        print(f"| {str(mode).lower()} | {rows[0]['saves']:.0f} | {blocking:.2f} | "
              f"{statistics.median(r['checkpoint_save_s'] for r in rows):.2f} | "
              f"{statistics.median(r['wall_s'] for r in rows):.1f} | {blocking / sync_blocking:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
