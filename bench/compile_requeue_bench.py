"""A requeued SLURM job's ``compile`` phase against its first attempt's (issue 37's target: <= 0.3x).

For each case, one compiled ``task=causal_lm model=gpt`` job with ``cluster=slurm`` on the local
cluster: the first attempt compiles and publishes its cache (``RUN/compile_cache``); as soon as the
file is there the bench sends ``scancel --signal=USR2``, the job checkpoints and requeues itself,
the bench releases SLURM's requeue hold, and the second attempt resumes. Each attempt's compile
seconds come from rank 0's log, its ``compile:`` line (``summary.json`` and the start-up line
are the last attempt's: a requeued attempt never reaches them). Wall-clock only: inductor builds
in worker processes that outlive the phase, so no CPU count of the phase is complete.

- ``another node``: each attempt with an empty inductor cache of its own
  (``TORCHINDUCTOR_CACHE_DIR`` set by a ``cluster.setup`` line from ``SLURM_RESTART_COUNT``), so all
  the requeue can reuse is the run directory's cache: a requeue onto other nodes.
- ``same node``: both attempts share one inductor cache, as a requeue onto the same node does.

    python bench/compile_requeue_bench.py [--steps 300] [--layers 4] [--d-model 128]
    python bench/compile_requeue_bench.py --root OTHER_CHECKOUT  # the same measure of other code
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
from pathlib import Path

from corpora import byte_corpus  # bench/, beside this file

COMPILE = re.compile(r"^compile: \d+ blocks in ([0-9.]+) s", re.MULTILINE)


def submit(args: argparse.Namespace, data: Path, run_dir: Path, inductor: str) -> str:
    """The job, not waited for; its SLURM id."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.train", "cluster=slurm", "cluster.wait=false", "task=causal_lm",
         "model=gpt", f"data.path={data}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
         f"model.d_model={args.d_model}", f"model.num_layers={args.layers}", "model.num_heads=4",
         "model.compile=true", f"parallelism.procs_per_node={args.ranks}", "optim.lr=1e-3",
         f"optim.max_steps={args.steps}", "log_every_steps=10", "logger=jsonl", "telemetry.enabled=false",
         "memory.estimate=off", f"cluster.setup=['export TORCHINDUCTOR_CACHE_DIR={inductor}']",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, cwd=args.root)
    found = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    if proc.returncode or not found:
        sys.exit(f"error: the job in {run_dir} was not submitted:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return found.group(1)


def squeue(job_id: str) -> list[str]:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True,
                          text=True).stdout.split()


def wait(what: str, done: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def requeued(args: argparse.Namespace, data: Path, run_dir: Path, inductor: str
             ) -> list[float]:
    """Both attempts' compile seconds (rank 0's ``compile:`` lines, in order)."""
    job_id = submit(args, data, run_dir, inductor)
    try:
        wait(f"job {job_id} never published its compile cache",
             lambda: any((run_dir / "compile_cache").glob("*.bin")), args.timeout_s)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        # SLURM holds a requeued job ~2 minutes (BeginTime); release it
        wait(f"job {job_id} was never held for requeue",
             lambda: squeue(job_id)[:2] == ["PENDING", "BeginTime"], args.timeout_s)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
        wait(f"job {job_id} never ended", lambda: not squeue(job_id), args.timeout_s)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    logs = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_0_log.out")))
    seconds = [float(s) for s in COMPILE.findall(logs)]
    summary = json.loads((run_dir / "summary.json").read_text())
    if len(seconds) != 2 or summary["compile"]["cache"] != "loaded":
        sys.exit(f"error: job {job_id} did not compile twice then load its cache "
                 f"(compile seconds {seconds}, cache {summary['compile']['cache']}):\n{logs[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the one node")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose jobs.train runs")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-requeue-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data = byte_corpus(tmp / "stdlib")
        for case, inductor in (("another node", f"{tmp}/inductor-$SLURM_RESTART_COUNT"),
                               ("same node", f"{tmp}/inductor-shared")):
            first, second = requeued(args, data, tmp / case.replace(" ", "-"), inductor)
            rows.append(f"| {case} | {first:.1f} | {second:.1f} | {second / first:.2f}x |")
    print("| requeued onto | first attempt compile s | requeued attempt compile s | ratio |")
    print("|---|---|---|---|\n" + "\n".join(rows))
    print(f"GPT d_model={args.d_model}, {args.layers} layers, seq_len {args.seq_len}, batch {args.batch}, "
          f"cluster=slurm, 1 node x {args.ranks} ranks, requeued by scancel --signal=USR2; "
          f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
