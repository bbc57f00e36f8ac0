"""Tokens/s of ``task=causal_lm model=gpt`` against a hand-written loop, same model, same data.

The hand-written loop is what a user writes without Switchyard (nanoGPT's shape): the whole token
stream in one array, a random window per row, forward, backward, AdamW step, the loss read on the
host only at log steps. Switchyard's side is ``python -m jobs.train cluster=debug`` (one rank in
the process, the same model, batch, sequence length and optimizer), its ``tokens_per_s`` taken from
``metrics.jsonl`` after the first window (start-up excluded on both sides). The two alternate,
``--repeats`` pairs, each in a fresh process; the ratio of medians is reported.

    python bench/lm_bench.py [--steps 120] [--repeats 3] [--d-model 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpora import byte_corpus  # bench/, beside this file

ROOT = Path(__file__).resolve().parents[1]

HAND_WRITTEN = """
import sys, time, numpy as np, torch
sys.path.insert(0, {root!r})
from jobs.models import GPT
from sharding import open_dataset
torch.manual_seed(0)
ds = open_dataset({data!r})
stream = torch.from_numpy(np.concatenate([ds.sample(i)["tokens"] for i in range(len(ds))]).astype(np.int64))
L, B, steps, log = {seq_len}, {batch}, {steps}, {log}
model = GPT(vocab_size=257, seq_len=L, d_model={d_model}, num_heads=4, num_layers={layers})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
start = None
for step in range(steps):
    if step == log:
        start = time.perf_counter()  # after the first log window, as on Switchyard's side
    rows = torch.randint(len(stream) - L - 1, (B,))
    window = torch.stack([stream[r:r + L + 1] for r in rows.tolist()])
    logits = model(window[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if (step + 1) % log == 0:
        loss.item()
print((steps - log) * B * L / (time.perf_counter() - start))
"""


def hand_written(args: argparse.Namespace, data: Path) -> float:
    code = HAND_WRITTEN.format(root=str(ROOT), data=str(data), seq_len=args.seq_len, batch=args.batch,
                               steps=args.steps, log=args.log, d_model=args.d_model, layers=args.layers)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def switchyard(args: argparse.Namespace, data: Path, run_dir: Path) -> float:
    subprocess.run([sys.executable, "-m", "jobs.train", "cluster=debug", "task=causal_lm", "model=gpt",
                    f"data.path={data}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
                    f"model.d_model={args.d_model}", f"model.num_layers={args.layers}", "model.num_heads=4",
                    "optim.lr=1e-3", f"optim.max_steps={args.steps}", f"log_every_steps={args.log}",
                    "logger=jsonl", "telemetry.enabled=false", "checkpoint.every_steps=0",
                    f"hydra.run.dir={run_dir}"], capture_output=True, text=True, check=True, cwd=ROOT)
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "tokens_per_s" in line][1:]  # the first window holds the start-up
    tokens = sum(w["tokens_per_s"] for w in windows) / len(windows)  # equal windows: a mean of rates
    return float(tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--log", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        data = byte_corpus(Path(tmp) / "stdlib")
        ours, theirs = [], []
        for repeat in range(args.repeats):
            started = time.perf_counter()
            theirs.append(hand_written(args, data))
            ours.append(switchyard(args, data, Path(tmp) / f"run{repeat}"))
            print(f"pair {repeat}: hand-written {theirs[-1]:,.0f} tokens/s, switchyard {ours[-1]:,.0f} "
                  f"tokens/s ({time.perf_counter() - started:.0f} s)", flush=True)
    mine, base = statistics.median(ours), statistics.median(theirs)
    print(f"\n| loop | tokens/s (median of {args.repeats}) | ratio |\n|---|---|---|")
    print(f"| hand-written (baseline) | {base:,.0f} | 1.00x |")
    print(f"| switchyard task=causal_lm, cluster=debug | {mine:,.0f} | {mine / base:.2f}x |")
    print(f"\nGPT d_model={args.d_model}, {args.layers} layers, seq_len {args.seq_len}, batch {args.batch}, "
          f"{args.steps} steps (the first {args.log} excluded), AdamW, fp32, CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
