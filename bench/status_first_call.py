"""The first `switchyard status` after 10,000 jobs were killed outright: every row whole, this
checkout against another revision, interleaved so both meet the same load.

One registry is built as ``bench/scale_sweeps.py`` builds its *killed* sweep (10,000 FAILED jobs,
each with its metrics, 60 telemetry samples and the fold its sampler kept, no end summary). Each
repeat runs, on fresh copies of it (nothing read yet), a new ``python -m orchestrator.cli status 1``
of this checkout, then of the other revision (with ``--read-all``, which an older revision needs to
fill every row, and without), then this checkout's next call. Wall time and CPU time (user +
system of the child) per call: on a shared machine the CPU time is the figure to compare.

    .venv/bin/python bench/status_first_call.py --before b1d9a4d --repeats 5
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import scale_sweeps  # noqa: E402 -- after the path is set


def call(src: Path, registry: Path, *extra: str) -> tuple[float, float, int, str]:
    """(wall s, CPU s, rows left unread, output) of one status call from ``src``."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--registry",
                           str(registry), *extra], cwd=src, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(src)})
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"status failed in {src}: {proc.stderr[-2000:]}")
    unread = re.search(r"^(\d+) ended jobs? not read yet", proc.stdout, re.MULTILINE)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, int(unread.group(1)) if unread else 0, proc.stdout


def measure(before: Path, label: str, repeats: int, root: Path) -> dict[str, list[tuple[float, float, int]]]:
    built, _, _ = scale_sweeps.build(root, "killed")
    runs = [("this checkout, first call", REPO, ()),
            (f"{label} --read-all, first call", before, ("--read-all",)),
            (f"{label}, first call", before, ())]
    figures: dict[str, list[tuple[float, float, int]]] = {}
    for i in range(repeats):
        for name, src, extra in runs:
            fresh = root / f"copy-{i}-{len(figures)}.db"
            shutil.copy(built, fresh)
            wall, cpu, unread, out = call(src, fresh, *extra)
            figures.setdefault(name, []).append((wall, cpu, unread))
            if src == REPO:
                assert unread == 0 and out.count("200/200") == scale_sweeps.NUM_JOBS, out[-2000:]
                wall, cpu, _, _ = call(src, fresh)
                figures.setdefault("this checkout, the call after", []).append((wall, cpu, 0))
        print(f"repeat {i + 1}/{repeats} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr,
              flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with (e.g. b1d9a4d)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="status-first-call-"))
    worktree = root / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.before],
                   check=True, capture_output=True)
    try:
        report(measure(worktree, args.before, args.repeats, root))
    finally:  # after the table: removing 10,000 run directories takes a while
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                       check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report(figures: dict[str, list[tuple[float, float, int]]]) -> None:
    print(f"| `status 1`, {scale_sweeps.NUM_JOBS:,} jobs killed outright | wall, median (min) | "
          f"CPU, median (min) | rows left unread |\n|---|---|---|---|")
    for name, runs in figures.items():
        walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
        unread = sorted({r[2] for r in runs})
        print(f"| {name} | {statistics.median(walls):.2f} s ({min(walls):.2f} s) | "
              f"{statistics.median(cpus):.2f} s ({min(cpus):.2f} s) | "
              f"{'none' if unread == [0] else ', '.join(f'{n:,}' for n in unread)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
