"""What each rank pays in imports today, and what one node would pay if a node launcher imported
once and forked its ranks (issue 39). Both now do: ``cluster=local``'s controller
(``orchestrator/launch/fork_start.py``; ``bench/fork_start_bench.py`` measures the real jobs) and
SLURM's node launcher (``orchestrator/launch/node_launcher.py``; ``bench/startup_bench.py``).

A "rank" here is what a ``jobs.train`` rank imports before its first step (submitit's entry,
``jobs.train``, the rank process and trainer, and the ``torch._dynamo`` that DDP's constructor
pulls in), then a 1-rank gloo DDP wrap of a small model. Measured on one node, CPU only:

- spawned (today): N fresh interpreters, each importing everything: the node's CPU seconds and
  files opened (``open`` audit events, counted in each process);
- forked (the design): one process imports, then forks N children that only build their DDP
  model: the node's CPU seconds (parent + children) and files opened after the fork.

    .venv/bin/python bench/rank_imports.py --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORK_TIMEOUT_S = 120  # a forked child has hung here (see docs/performance.md): shown as nan

IMPORTS = """
import sys
opened = [0]
sys.addaudithook(lambda event, args: opened.__setitem__(0, opened[0] + (event == "open")))
import submitit.core.submission, jobs.train, orchestrator.training.rank_process, torch._dynamo
"""

WORK = """
import os, datetime, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
def rank_work(store_path):
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # after the fork: each rank seeds its own generator
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 10)))
    model(torch.randn(8, 64)).sum().backward()
    dist.destroy_process_group()
"""

SPAWNED = IMPORTS + WORK + """
rank_work(sys.argv[1])
print(opened[0])
"""

FORKED = IMPORTS + WORK + """
import json, resource
opened_parent = opened[0]
n = int(sys.argv[2])
pids = []
for i in range(n):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        opened[0] = 0
        torch.set_num_threads(1)  # the intra-op pool: started after the fork, in the child
        rank_work(f"{sys.argv[1]}-{i}")
        os.write(w, str(opened[0]).encode())
        os._exit(0)
    os.close(w)
    pids.append((pid, r))
child_opens = []
for pid, r in pids:
    child_opens.append(int(os.read(r, 64) or b"0"))
    os.waitpid(pid, 0)
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "opened_parent": opened_parent, "opened_children": child_opens}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def spawned(n: int, tmp: Path) -> dict[str, float]:
    """N interpreters at once, each importing everything (today's start): the node's figures."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", SPAWNED, str(tmp / f"s{n}-{i}")], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    opened = [int(p.communicate()[0].split()[-1]) for p in procs]
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, "opened": sum(opened)}


def forked(n: int, tmp: Path) -> dict[str, float]:
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", FORKED, str(tmp / f"f{n}"), str(n)], cwd=REPO, env=_env(),
                             capture_output=True, text=True, check=True, timeout=FORK_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:  # a forked rank hung: the finding, not a crash of the bench
        return {"cpu_s": float("nan"), "wall_s": time.perf_counter() - start, "opened": float("nan")}
    figures = json.loads(out.splitlines()[-1])
    return {"cpu_s": figures["cpu_s"], "wall_s": time.perf_counter() - start,
            "opened": figures["opened_parent"] + sum(figures["opened_children"])}


def bare(tmp: Path) -> float:
    """An interpreter that imports nothing: the floor under both."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="ranks per node to measure")
    parser.add_argument("--starts", default="spawned,forked", help="which starts to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rank-imports-") as tmp:
        spawned(1, Path(tmp))  # warm the page cache: both starts then read the same cached files
        print(f"bare interpreter: {bare(Path(tmp)):.2f} s CPU")
        print("| ranks per node | start | CPU s per node | wall s | files opened per node |")
        print("|---|---|---|---|---|")
        for n in args.ranks:
            starts = (("spawned (today)", spawned), ("forked (design)", forked))
            for name, run in [(k, f) for k, f in starts if k.split()[0] in args.starts]:
                f = run(n, Path(tmp))
                print(f"| {n} | {name} | {f['cpu_s']:.2f} | {f['wall_s']:.2f} | {f['opened']:.0f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
