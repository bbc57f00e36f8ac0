"""Sweep submission benchmark: a 100-point Hydra sweep through Switchyard's launcher and through
hydra-submitit-launcher, side by side on the local SLURM cluster.

What it measures (docs/performance.md, "Sweep submission", holds the table and how to read it):

- how many times each launcher calls ``sbatch``, ``sacct`` and ``squeue`` (wrappers first on PATH
  log every call and pass it on to the real command);
- seconds from the command's start until its last ``sbatch`` returned (the sweep is queued: the
  earliest a user could walk away), and until the command returned;
- the same for Switchyard in blocking mode, and for a 100-point ``jobs.train`` sweep (submission
  only: composing and checking 100 typed configs, then one array, cancelled right away).

The app is trivial (it returns its ``x``), so the figures are launcher overhead plus SLURM's own
scheduling of 100 one-CPU tasks on the 2-node, 4-CPU local cluster.

How to run. hydra-submitit-launcher goes in a directory of its own (not the project's venv), which
only the baseline's runs see::

    .venv/bin/pip install --no-deps --target /tmp/hsl-site hydra-submitit-launcher==1.2.0
    .venv/bin/python bench/sweep_bench.py --baseline-site /tmp/hsl-site --markdown /tmp/sweep_bench.md

Without ``--baseline-site`` only Switchyard's rows are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
APP = """
import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg: DictConfig) -> int:
    return int(cfg.x)


if __name__ == "__main__":
    main()
"""
CONFIG = """
defaults:
  - _self_
  - override hydra/launcher: {launcher}
x: 0
hydra:
  launcher:
    timeout_min: 5
  sweep:
    dir: {sweep_dir}
"""
WRAPPER = """#!/bin/sh
echo "$(date +%s.%N) {name} start" >> "$SWEEP_BENCH_LOG"
"{real}" "$@"
rc=$?
echo "$(date +%s.%N) {name} end" >> "$SWEEP_BENCH_LOG"
exit $rc
"""


@dataclass
class Row:
    launcher: str
    mode: str
    points: int
    sbatch_calls: int
    sacct_calls: int
    squeue_calls: int
    queued_s: float  # start -> the last sbatch returned
    returned_s: float  # start -> the command returned
    exit_code: int


def wrap_slurm_commands(bin_dir: Path) -> None:
    """sbatch/sacct/squeue wrappers that log each call, first on PATH for the runs."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sbatch", "sacct", "squeue"):
        real = shutil.which(name)
        if real is None:
            sys.exit(f"{name} not found: is the local cluster up? (switchyard cluster up)")
        path = bin_dir / name
        path.write_text(WRAPPER.format(name=name, real=real))
        path.chmod(0o755)


def write_app(work: Path, launcher: str) -> Path:
    app_dir = work / launcher
    app_dir.mkdir(parents=True, exist_ok=True)
    (app_dir / "app.py").write_text(APP)
    (app_dir / "config.yaml").write_text(CONFIG.format(launcher=launcher, sweep_dir=app_dir / "multirun"))
    return app_dir


def measure(label: str, mode: str, points: int, cmd: list[str], cwd: Path, work: Path,
            extra_env: dict[str, str]) -> Row:
    log = work / f"calls-{label}-{mode}.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, **extra_env, "SWEEP_BENCH_LOG": str(log),
           "PATH": f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "SWITCHYARD_REGISTRY": str(work / "registry.db")}
    start = time.time()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    returned = time.time() - start
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    sbatch_ends = [float(t) for t, name, what in calls if name == "sbatch" and what == "end"]
    count = {name: sum(1 for _, n, what in calls if n == name and what == "start")
             for name in ("sbatch", "sacct", "squeue")}
    row = Row(label, mode, points, count["sbatch"], count["sacct"], count["squeue"],
              round(max(sbatch_ends) - start, 2) if sbatch_ends else float("nan"), round(returned, 2),
              proc.returncode)
    print(json.dumps(asdict(row)), flush=True)
    return row


def wait_for_queue_to_drain(job_name: str, timeout_s: float = 600) -> None:
    """Runs must not overlap: the next one starts on an idle cluster."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-n", job_name], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            sys.exit(f"jobs named {job_name} still queued after {timeout_s} s")
        time.sleep(1)


def run_all(args: argparse.Namespace, work: Path) -> list[Row]:
    wrap_slurm_commands(work / "bin")
    python, points = sys.executable, args.points
    sweep = f"x=range(0,{points})"
    rows: list[Row] = []
    app = write_app(work, "switchyard_slurm")
    for mode, flag in (("non-blocking", "false"), ("blocking", "true")):
        for _ in range(args.repeats):
            cmd = [python, "app.py", "-m", sweep, f"hydra.launcher.wait={flag}"]
            rows.append(measure("switchyard_slurm", mode, points, cmd, app, work, {}))
            wait_for_queue_to_drain("app")
    if args.baseline_site:
        base = write_app(work, "submitit_slurm")
        for _ in range(args.repeats):
            rows.append(measure("hydra-submitit-launcher 1.2.0", "blocking (only mode)", points,
                                [python, "app.py", "-m", sweep], base, work,
                                {"PYTHONPATH": str(Path(args.baseline_site).resolve())}))
            wait_for_queue_to_drain("app")
    if not args.skip_train:
        rows.append(train_submission(args, work))
    return rows


def train_submission(args: argparse.Namespace, work: Path) -> Row:
    """jobs.train, 100 points: the submit side's cost of typed checks per point. Cancelled at once."""
    cmd = [sys.executable, "-m", "jobs.train", "-m", f"seed=range(0,{args.points})", "cluster=slurm",
           "cluster.wait=false", "cluster.job_name=sweep-bench-train",
           f"hydra.sweep.dir={work / 'train-multirun'}", f"data.cache_dir={work / 'cache'}",
           "data.demo_num_samples=256"]
    row = measure("switchyard_slurm (jobs.train)", "non-blocking", args.points, cmd, REPO, work, {})
    subprocess.run(["scancel", "-n", "sweep-bench-train"], check=False)
    wait_for_queue_to_drain("sweep-bench-train")
    return row


def markdown(rows: list[Row]) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} ({os.cpu_count()} cores), "
             f"local SLURM cluster (2 nodes x 2 CPUs), Python {platform.python_version()}.", "",
             "| launcher | mode | points | sbatch calls | sacct calls | squeue calls | "
             "queued after (s) | command returned after (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.launcher} | {r.mode} | {r.points} | {r.sbatch_calls} | {r.sacct_calls} | "
                     f"{r.squeue_calls} | {r.queued_s:.1f} | {r.returned_s:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (each is printed)")
    parser.add_argument("--baseline-site", default=None,
                        help="a directory holding hydra-submitit-launcher (pip install --target)")
    parser.add_argument("--skip-train", action="store_true", help="leave out the jobs.train row")
    parser.add_argument("--markdown", default=None, help="write the table here too")
    parser.add_argument("--work-dir", default=None, help="keep runs here (default: a temp dir)")
    args = parser.parse_args()
    if args.work_dir:
        rows = run_all(args, Path(args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
            rows = run_all(args, Path(tmp))
    table = markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
