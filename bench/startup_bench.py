"""Submit -> done: a 1-step 2x2 ``jobs.train`` job against a bare ``sbatch`` + ``srun`` script that
does a gloo DDP init and one all-reduce, on the local SLURM cluster (issue 30's target: at most 1.3x).
``jobs.train`` runs once per ``--starts`` (``auto``: one node launcher per node forks the ranks;
``spawn``: srun starts every rank), so both starts are measured against the same bare runs.

The machine's CPU seconds (``/proc/stat``: every process, the SLURM daemons included) are read
around each run: on a quiet machine they are what the job cost, whoever spent them.

Each pair runs the two whole commands one after the other, alternating which goes first, so a drift
in the machine's speed hits both; the ratio is taken pair by pair and its median reported. Both
wait for their job: the bare script's submitter asks ``squeue`` every 0.1 s until the job is gone
(``sbatch --wait`` asks every 10 s), ``jobs.train`` as it does by default.

For each ``jobs.train`` run it also reports where the seconds went:

- on the submitting side, from the lines it prints (``run_dir:`` after the config and the checks,
  ``job:`` once sbatch returned, ``summary:`` once the result was read) and the process's exit;
- on rank 0, ``summary.json``'s ``startup_s`` (process start -> first step: imports, preflight,
  rendezvous, data, model, resume, first step) and ``ending_s`` (last step -> result).

The warm-up run before the rounds makes the demo dataset and the code snapshot, and its memory
estimate is remembered (``memory.estimate_cache``), so each measured run is a resubmission of the
same step; pass ``memory.estimate_cache=null`` to measure first submissions, whose estimate runs.

Run on a quiet machine (figures in docs/performance.md, "Start-up")::

    .venv/bin/switchyard cluster up
    .venv/bin/python bench/startup_bench.py --pairs 3 --starts auto spawn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

BARE_RANK = """
import os, datetime, torch, torch.distributed as dist
store = dist.TCPStore(os.environ["MASTER_ADDR"], 29731, int(os.environ["SLURM_NTASKS"]),
                      int(os.environ["SLURM_PROCID"]) == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=int(os.environ["SLURM_PROCID"]),
                        world_size=int(os.environ["SLURM_NTASKS"]))
t = torch.ones(1)
dist.all_reduce(t)
assert int(t.item()) == dist.get_world_size()
dist.destroy_process_group()
"""

BARE_SCRIPT = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --output={out}/%j.out
#SBATCH --error={out}/%j.err
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun {python} {rank}
"""


def machine_cpu_s() -> float:
    """CPU seconds every process of this machine has used since boot (user + nice + system)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def bare(work: Path) -> dict[str, float]:
    rank = work / "bare_rank.py"
    rank.write_text(BARE_RANK)
    script = work / "bare.sbatch"
    script.write_text(BARE_SCRIPT.format(out=work, python=sys.executable, rank=rank))
    cpu = machine_cpu_s()
    started = time.monotonic()
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sbatch refused the bare job: {proc.stderr}")
    job_id = proc.stdout.strip().split(";")[0]
    # Until the controller no longer lists it, asked every 0.1 s (sbatch --wait asks every 10 s).
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                         text=True).stdout.strip():
        time.sleep(0.1)
    seconds = time.monotonic() - started
    cpu = machine_cpu_s() - cpu
    for _ in range(100):  # accounting may lag the controller by a few seconds (not timed)
        state = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True,
                               text=True).stdout.split()
        if state and state[0] not in ("PENDING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.1)
    if state and state[0] != "COMPLETED":
        raise SystemExit(f"the bare job {job_id} ended {state[0]}: see {work}/{job_id}.err")
    return {"total_s": seconds, "cpu_s": cpu}


def switchyard(work: Path, index: str, start: str, overrides: list[str]) -> dict[str, Any]:
    run_dir = work / f"run-{index}-{start}"
    command = [sys.executable, "-m", "jobs.train", "cluster=slurm", "parallelism.nodes=2",
               f"cluster.rank_start={start}",
               "parallelism.procs_per_node=2", "optim.max_steps=1", "data.demo_num_samples=64",
               "telemetry.enabled=false", "logger.tensorboard=false", f"data.cache_dir={work / 'cache'}",
               f"hydra.run.dir={run_dir}", *overrides]
    cpu = machine_cpu_s()
    started = time.monotonic()
    marks: dict[str, float] = {}
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            for prefix in ("run_dir:", "job:", "summary:"):
                if line.startswith(prefix) and prefix not in marks:
                    marks[prefix] = time.monotonic() - started
    total = time.monotonic() - started
    cpu = machine_cpu_s() - cpu
    if proc.returncode != 0 or "summary:" not in marks:
        raise SystemExit(f"jobs.train failed (exit {proc.returncode}); see {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"total_s": total, "cpu_s": cpu, "checks_s": marks.get("run_dir:", 0.0),
            "submitted_s": marks.get("job:", 0.0), "result_s": marks["summary:"],
            "exit_s": total - marks["summary:"], "startup_s": summary.get("startup_s", {}),
            "ending_s": summary.get("ending_s", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--starts", nargs="+", default=["auto"], choices=["auto", "fork", "spawn"],
                        help="cluster.rank_start of the jobs.train runs, each measured in every round")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("overrides", nargs="*", help="further jobs.train overrides, e.g. memory.estimate=off")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    for start in args.starts:  # warm-up: the demo data, the code snapshot, the page cache, the estimate
        switchyard(work, "warm", start, args.overrides)
    bare(work)
    runs: list[dict[str, Any]] = []
    arms = ["bare", *args.starts]
    for pair in range(args.pairs):
        order = arms[pair % len(arms):] + arms[:pair % len(arms)]  # each arm leads in turn
        figures: dict[str, Any] = {}
        for which in order:
            figures[which] = (bare(work) if which == "bare"
                              else switchyard(work, str(pair), which, args.overrides))
        for start in args.starts:
            figures[f"ratio_{start}"] = figures[start]["total_s"] / figures["bare"]["total_s"]
        runs.append(figures)
        base = figures["bare"]
        said = "; ".join(f"jobs.train {start} {figures[start]['total_s']:.2f} s "
                         f"({figures[start]['cpu_s']:.2f} CPU s), ratio {figures[f'ratio_{start}']:.2f}"
                         for start in args.starts)
        print(f"round {pair}: bare {base['total_s']:.2f} s ({base['cpu_s']:.2f} CPU s); {said}", flush=True)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    print(f"\nbare sbatch+srun: {median([r['bare']['total_s'] for r in runs]):.2f} s, "
          f"{median([r['bare']['cpu_s'] for r in runs]):.2f} machine CPU s (medians)")
    for start in args.starts:
        ours = [r[start] for r in runs]
        print(f"\njobs.train cluster.rank_start={start}: median ratio to bare "
              f"{median([r[f'ratio_{start}'] for r in runs]):.2f} "
              f"({median([o['total_s'] for o in ours]):.2f} s, "
              f"{median([o['cpu_s'] for o in ours]):.2f} machine CPU s)")
        print("  submitting side (median s): " + ", ".join(
            f"{name} {median([o[key] for o in ours]):.2f}" for name, key in
            (("config and checks", "checks_s"), ("to sbatch returned", "submitted_s"),
             ("to result read", "result_s"), ("exit after the result", "exit_s"))))
        for section in ("startup_s", "ending_s"):
            names = list(ours[0][section])
            print(f"  rank 0 {section} (median s): " + ", ".join(
                f"{name} {median([o[section].get(name, 0.0) for o in ours]):.2f}" for name in names))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
