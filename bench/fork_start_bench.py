"""Forked against started ranks (``cluster.rank_start``, issue 39): a 1-step ``cluster=local``
``jobs.train`` job with N ranks on this machine, started both ways, in pairs.

For each run: the wall seconds of the whole command, the CPU seconds of everything it ran (the
submitting process, the job's controller and its ranks: all waited for, so all in this process's
``RUSAGE_CHILDREN``), and rank 0's seconds from its process start to its first step
(``summary.json``'s ``startup_s``). Each pair runs both starts one after the other, alternating
which goes first; the medians and their ratios (forked / started) are reported. Run on a quiet
machine::

    .venv/bin/python bench/fork_start_bench.py --ranks 2 4 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = ["optim.max_steps=1", "data.demo_num_samples=512", "data.batch_size=16", "memory.estimate=off",
       "telemetry.enabled=false", "logger.tensorboard=false"]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(start: str, ranks: int, tmp: Path, cache: Path) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(dir=tmp)) / "run"
    cpu, began = children_cpu_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "jobs.train", *JOB, f"parallelism.procs_per_node={ranks}",
                    f"cluster.rank_start={start}", f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"],
                   cwd=REPO, check=True, capture_output=True)
    wall, cpu = time.perf_counter() - began, children_cpu_s() - cpu
    startup = json.loads((run_dir / "summary.json").read_text())["startup_s"]
    return {"wall_s": wall, "cpu_s": cpu, "rank0_to_first_step_s": startup["to_first_step"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="ranks of the local job")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fork-start-") as scratch:
        tmp = Path(scratch)
        run("spawn", 1, tmp, tmp / "cache")  # the demo data, and a warm page cache for both
        print("| ranks | start | wall s | CPU s (all processes) | rank 0: start to first step, s |")
        print("|---|---|---|---|---|")
        for ranks in args.ranks:
            figures: dict[str, list[dict[str, float]]] = {"fork": [], "spawn": []}
            for pair in range(args.pairs):
                for start in (("fork", "spawn") if pair % 2 == 0 else ("spawn", "fork")):
                    figures[start].append(run(start, ranks, tmp, tmp / "cache"))
            medians = {start: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                       for start, runs in figures.items()}
            for start, name in (("spawn", "started (before)"), ("fork", "forked")):
                m = medians[start]
                print(f"| {ranks} | {name} | {m['wall_s']:.2f} | {m['cpu_s']:.2f} | "
                      f"{m['rank0_to_first_step_s']:.2f} |")
            ratio = {k: medians["fork"][k] / medians["spawn"][k] for k in medians["fork"]}
            print(f"| {ranks} | forked / started | {ratio['wall_s']:.2f}x | {ratio['cpu_s']:.2f}x | "
                  f"{ratio['rank0_to_first_step_s']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
