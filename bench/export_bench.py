"""What exporting while training costs the step loop, against what asynchronous checkpointing
costs it: ``checkpoint.export=hf checkpoint.export_every=1`` beside ``checkpoint.async_save=true``.

A ``model=gpt`` of about 3.2M parameters (``d_model=256``, 4 layers; 38 MB of model and AdamW
state per checkpoint) on byte tokens of the standard library's sources, 2 local CPU ranks, a
checkpoint every ``--every`` steps. Three modes, alternating, each a fresh ``python -m jobs.train``:

- ``none``: no checkpoint but the final one;
- ``async``: ``checkpoint.every_steps=E``, ``async_save=true``;
- ``async+export``: the same and ``checkpoint.export=hf``, every checkpoint (``export_every=1``).

The figure is what each costs the loop in waits, measured directly: ``summary.json``'s
``checkpoint_blocking_s`` (the loop's waits for saves, the final save included) plus, with export,
``exports.loop_s`` (the exporter's work on the loop's thread: staging hard links, queueing).
Async checkpointing costs ``async - none``, exporting ``async+export - async``; the ratio of the
two is the figure (target: below 1). The loop's wall time (``wall_s`` less the final wait for the
last export, ``exports.end_wait_s``) is printed too: it also holds what the background work took
from the steps' CPU, but on a shared machine it is dominated by the other load.

    python bench/export_bench.py [--steps 40] [--every 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["task=causal_lm", "model=gpt", "model.d_model=256", "model.num_heads=4", "model.num_layers=4",
         "data.seq_len=64", "data.batch_size=8", "logger=jsonl", "telemetry.enabled=false",
         "memory.estimate=off"]
MODES = {"none": [], "async": ["checkpoint.async_save=true"],
         "async+export": ["checkpoint.async_save=true", "checkpoint.export=hf", "checkpoint.export_every=1"]}


def prepare(tmp: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = tmp / "corpus"
    source.mkdir()
    for path in sorted(stdlib.glob("[a-m]*.py")):
        (source / path.name).write_bytes(path.read_bytes())
    subprocess.run([sys.executable, "-m", "jobs.prepare", f"input={source}", f"output={tmp / 'data'}",
                    "format=text", "tokenizer=bytes"], capture_output=True, text=True, check=True, cwd=ROOT)
    return tmp / "data"


def run(tmp: Path, data: Path, name: str, mode: str, steps: int, every: int) -> dict[str, Any]:
    run_dir = tmp / name
    saving = [f"checkpoint.every_steps={every}"] if mode != "none" else []
    subprocess.run([sys.executable, "-m", "jobs.train", *MODEL, f"data.path={data}",
                    f"optim.max_steps={steps}", *saving, *MODES[mode], f"hydra.run.dir={run_dir}"],
                   capture_output=True, text=True, check=True, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    exports = summary.get("exports") or {}
    return {"loop_s": float(summary["wall_s"]) - float(exports.get("end_wait_s") or 0.0),
            "blocking_s": float(summary["checkpoint_blocking_s"]), "saves": summary["checkpoint_saves"],
            "export_loop_s": float(exports.get("loop_s") or 0.0),
            "exported": len(exports.get("exported_steps") or []),
            "skipped": len(exports.get("skipped_steps") or []), "failed": exports.get("failed") or [],
            "export_s": exports.get("export_s") or []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data = prepare(tmp)
        for repeat in range(args.repeats):
            for mode in MODES:
                results[mode].append(run(tmp, data, f"{mode}-{repeat}", mode, args.steps, args.every))
                print(f"repeat {repeat} {mode}: {results[mode][-1]}", flush=True)
    report(results, args.repeats)
    return 0


def report(results: dict[str, list[dict[str, Any]]], repeats: int) -> None:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    print(f"\n| mode | saves | loop's waits, s (median of {repeats}) | loop wall s | exported | skipped |"
          f"\n|---|---|---|---|---|---|")
    waits = {mode: median(mode, "blocking_s") + median(mode, "export_loop_s") for mode in results}
    for mode, rows in results.items():
        exported = "- | -" if mode != "async+export" else \
            f"{median(mode, 'exported'):g} | {median(mode, 'skipped'):g}"
        wall = median(mode, "loop_s")
        print(f"| {mode} | {rows[0]['saves']} | {waits[mode]:.2f} | {wall:.1f} | {exported} |")
    checkpointing, exporting = waits["async"] - waits["none"], waits["async+export"] - waits["async"]
    ratio = exporting / checkpointing if checkpointing > 0 else float("nan")
    wall_ckpt = median("async", "loop_s") - median("none", "loop_s")
    wall_export = median("async+export", "loop_s") - median("async", "loop_s")
    seconds = [s for r in results["async+export"] for s in r["export_s"]]
    one = statistics.median(seconds) if seconds else 0.0
    print(f"\nin waits: async checkpointing costs the loop {checkpointing:.2f} s, exporting "
          f"{exporting:.2f} s: {ratio:.2f}x; the exporter's own share "
          f"{median('async+export', 'export_loop_s') * 1000:.1f} ms. In wall time: {wall_ckpt:.1f} s and "
          f"{wall_export:.1f} s. One export (its subprocess): {one:.1f} s; "
          f"failed: {[f for r in results['async+export'] for f in r['failed']]}")


if __name__ == "__main__":
    sys.exit(main())
