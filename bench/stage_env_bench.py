"""Would staging the virtual environment on node-local disk pay? (issue 39, ``cluster.stage_env``)

N ranks that start on one node at once each import what a ``jobs.train`` rank imports before its
first step (submitit's entry, ``jobs.train``, the rank process and trainer, ``torch._dynamo``).
Where that environment lives on a shared file system (Lustre, GPFS, NFS), the node's ranks read
thousands of small files from it at once, and every node of the job does the same: the import
storm. This bench times that start from the environment where it is, against a copy staged on
node-local disk, with the page cache dropped before each start (root only; otherwise it says it
measured warm starts, which show no file system at all), and reports the one-off cost of the
copy. Run it on a compute node of the cluster in question, with the venv the jobs use::

    srun -N1 --exclusive python bench/stage_env_bench.py --ranks 8 --stage-dir /local/scratch

Staging pays on that cluster when (cold start from where it is - cold start staged) x the starts
per node a job makes (1, plus one per requeue) exceeds the copy's cost: the copy runs once per node
per job, before its ranks start. On the project's CI machine both copies are on the same local
disk, so the bench can only show the copy's cost there (docs/performance.md, "Environment
staging").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RANK_IMPORTS = """
import sys
opened = [0]
sys.addaudithook(lambda event, args: opened.__setitem__(0, opened[0] + (event == "open")))
import submitit.core.submission, jobs.train, orchestrator.training.rank_process, torch._dynamo
print(opened[0], sys.prefix)
"""


def drop_page_cache() -> bool:
    """Every file read from disk again, as on a node that has not read them yet; root only."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def start(python: Path, ranks: int, cold: bool) -> tuple[float, int, str]:
    """``ranks`` interpreters at once from ``python``'s environment: wall seconds until the last
    one has imported, files each opened, and the prefix they imported from."""
    if cold and not drop_page_cache():
        raise SystemExit("cannot drop the page cache (not root): run with --warm, or as root")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    procs = [subprocess.Popen([str(python), "-c", RANK_IMPORTS], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
    outs = [p.communicate()[0].split() for p in procs]
    wall = time.perf_counter() - began
    if any(p.returncode for p in procs):
        raise SystemExit(f"{python} could not import a rank's modules (exit "
                         f"{[p.returncode for p in procs]})")
    return wall, int(outs[0][0]), outs[0][1]


def stage(venv: Path, stage_dir: Path) -> tuple[Path, float, int]:
    """Copy ``venv`` under ``stage_dir`` as a node would before its ranks start (symlinks kept:
    the venv's ``bin/python`` points at its base interpreter). Returns the copy, seconds, bytes."""
    target = Path(tempfile.mkdtemp(prefix="staged-venv-", dir=stage_dir)) / venv.name
    began = time.perf_counter()
    shutil.copytree(venv, target, symlinks=True)
    seconds = time.perf_counter() - began
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file() and not f.is_symlink())
    return target, seconds, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix), help="the jobs' environment")
    parser.add_argument("--stage-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="node-local disk to stage it on")
    parser.add_argument("--ranks", type=int, default=8, help="ranks starting on the node at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="keep the page cache (not root)")
    args = parser.parse_args()
    if not (args.venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"--venv={args.venv} is not a virtual environment (no pyvenv.cfg)")
    staged, copy_s, size = stage(args.venv, args.stage_dir)
    try:
        rows = []
        for name, venv in (("where it is", args.venv), ("staged", staged)):
            runs = [start(venv / "bin" / "python", args.ranks, cold=not args.warm)
                    for _ in range(args.repeats)]
            prefix = runs[0][2]
            if Path(prefix).resolve() != venv.resolve():
                raise SystemExit(f"the {name} start imported from {prefix}, not {venv}")
            rows.append((name, venv, statistics.median(r[0] for r in runs), runs[0][1]))
    finally:
        shutil.rmtree(staged.parent)
    cache = "warm page cache" if args.warm else "page cache dropped before each start"
    print(f"{args.ranks} ranks at once, {cache}, median of {args.repeats}")
    print("| environment | path | s to imported (all ranks) | files opened per rank |")
    print("|---|---|---|---|")
    for name, venv, wall, opened in rows:
        print(f"| {name} | {venv} | {wall:.2f} | {opened:,} |")
    saved = rows[0][2] - rows[1][2]
    print(f"copy to {args.stage_dir}: {copy_s:.1f} s for {size / 2**30:.2f} GiB, once per node per job")
    print(f"staged start saves {saved:.2f} s per start: "
          + (f"pays after {copy_s / saved:.1f} starts per node" if saved > 0 else "never pays here"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
