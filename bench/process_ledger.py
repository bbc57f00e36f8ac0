"""Sum a process ledger (``bench/process_ledger/sitecustomize.py``) by kind of process.

    PYTHONPATH=bench/process_ledger PROC_LEDGER=/tmp/procs.jsonl make pytest
    python bench/process_ledger.py /tmp/procs.jsonl [--by-test]

Kinds: the submitting ``jobs.train``, a local job's controller, a SLURM node launcher, a rank
(started as its own process, or forked from a controller or launcher), ``switchyard`` commands,
and everything else by its script's name. ``--by-test`` adds the CPU of each test file.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any


def kind(line: dict[str, Any]) -> str:
    argv = [str(a) for a in line.get("argv") or []]
    first = argv[0] if argv else ""
    forked = line.get("forked", False)
    if first.endswith("_submit.py"):  # a forked rank takes submitit's argv, as a started one has
        return "rank, forked" if forked else "rank, started"
    if "fork_start" in first:
        return "local controller"
    if "node_launcher" in first:
        return "SLURM node launcher"
    if first.endswith(("jobs/train.py", "train.py")):
        return "jobs.train"
    if first.endswith("switchyard") or first.endswith("cli.py"):
        return f"switchyard {argv[1] if len(argv) > 1 else ''}".strip()
    if first == "-c":
        return "python -c (pytest-xdist workers, tests' scripts)" + (", forked" if forked else "")
    return Path(first).name or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--by-test", action="store_true")
    args = parser.parse_args()
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    by_test: collections.Counter[str] = collections.Counter()
    for text in args.ledger.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue  # a line cut short by a killed process
        cpu[kind(line)] += line["cpu"]
        count[kind(line)] += 1
        by_test[line.get("test", "").split("::")[0] or "(no test)"] += line["cpu"]
    print(f"{sum(cpu.values()):.0f} CPU s in {sum(count.values())} processes\n")
    print("| CPU s | processes | s each | kind |\n|---:|---:|---:|---|")
    for name, seconds in cpu.most_common():
        print(f"| {seconds:.1f} | {count[name]} | {seconds / count[name]:.2f} | {name} |")
    if args.by_test:
        print("\n| CPU s | test file |\n|---:|---|")
        for name, seconds in by_test.most_common(30):
            print(f"| {seconds:.1f} | {name} |")


if __name__ == "__main__":
    main()
