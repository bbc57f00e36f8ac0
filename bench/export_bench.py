"""What exporting while training costs the step loop, against what asynchronous checkpointing
costs it: ``checkpoint.export=hf checkpoint.export_every=1`` beside ``checkpoint.async_save=true``.

A ``model=gpt`` of about 10M parameters (``d_model=384``, 6 layers; 130 MB of model and AdamW
state per checkpoint) on byte tokens of the standard library's sources, 2 local CPU ranks, a
checkpoint every ``--every`` steps. Three modes, alternating, each a fresh ``python -m jobs.train``:

- ``none``: no checkpoint but the final one;
- ``async``: ``checkpoint.every_steps=E``, ``async_save=true``;
- ``async+export``: the same and ``checkpoint.export=hf``, every checkpoint (``export_every=1``).

The loop's time is ``summary.json``'s ``wall_s`` less the final wait for the last export
(``exports.end_wait_s``): the steps, the saves' waits and whatever the background work took from
them. Async checkpointing costs the loop ``async - none``; exporting costs it ``async+export -
async``; the ratio of the two is the figure (target: below 1). The exporter's direct share of the
loop (``exports.loop_s``: staging hard links, queueing) is printed beside it.

    python bench/export_bench.py [--steps 60] [--every 10] [--repeats 2]
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
MODEL = ["task=causal_lm", "model=gpt", "model.d_model=384", "model.num_heads=6", "model.num_layers=6",
         "data.seq_len=128", "data.batch_size=8", "logger=jsonl", "telemetry.enabled=false",
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
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
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
    loop = {mode: statistics.median(r["loop_s"] for r in rows) for mode, rows in results.items()}
    with_export = results["async+export"]
    print(f"\n| mode | saves | loop s (median of {repeats}) | loop's wait for saves, s | exported | "
          f"skipped |\n|---|---|---|---|---|---|")
    for mode, rows in results.items():
        print(f"| {mode} | {rows[0]['saves']} | {loop[mode]:.1f} | "
              f"{statistics.median(r['blocking_s'] for r in rows):.2f} | "
              f"{statistics.median(r['exported'] for r in rows) if mode == 'async+export' else '-'} | "
              f"{statistics.median(r['skipped'] for r in rows) if mode == 'async+export' else '-'} |")
    checkpointing, exporting = loop["async"] - loop["none"], loop["async+export"] - loop["async"]
    direct = statistics.median(r["export_loop_s"] for r in with_export)
    seconds = [s for r in with_export for s in r["export_s"]]
    print(f"\nasync checkpointing costs the loop {checkpointing:.2f} s, exporting {exporting:.2f} s: "
          f"{exporting / checkpointing if checkpointing > 0 else float('nan'):.2f}x; the exporter's "
          f"direct share of the loop {direct * 1000:.1f} ms; one export (subprocess) "
          f"{statistics.median(seconds) if seconds else float('nan'):.1f} s; "
          f"failed: {[f for r in with_export for f in r['failed']]}")


if __name__ == "__main__":
    sys.exit(main())
