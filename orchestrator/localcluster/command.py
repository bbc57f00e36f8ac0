"""``switchyard cluster up|status|down``: its arguments and what each action does.

Standard library only, as ``cluster`` is, so ``python3 -m orchestrator.localcluster up`` runs from a
checkout before its virtual environment exists: ``make test`` brings the cluster up (installing
SLURM's Debian packages on a new machine) while the environment is being built.
"""

from __future__ import annotations

import argparse

from orchestrator.localcluster import cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "status", "down"])
    p.add_argument("--state-dir", default=None,
                   help=f"where config, logs, pid files and the database live "
                        f"(default ${cluster.STATE_DIR_ENV} or {cluster.DEFAULT_STATE_DIR})")
    p.add_argument("--no-install", action="store_true",
                   help="fail instead of installing missing Debian packages")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="how long up waits for the nodes to become idle")
    p.add_argument("--gpus", type=int, default=cluster.DEFAULT_GPUS_PER_NODE, metavar="N",
                   help="GPUs each node advertises as GRES (character devices, no hardware; 0: none; "
                        f"default {cluster.DEFAULT_GPUS_PER_NODE})")


def run(args: argparse.Namespace) -> int:
    """The action's exit status (status: 3 when the cluster is not up); ClusterError on failure."""
    if args.gpus < 0:
        raise cluster.ClusterError(f"--gpus {args.gpus} is invalid: must be >= 0 (try --gpus 2)")
    layout = cluster.Layout.from_env(args.state_dir, gpus_per_node=args.gpus)
    if args.action == "up":
        cluster.up(layout, install=not args.no_install, timeout_s=args.timeout_s)
        print(cluster.status(layout)[1])
        print("cluster is up: submit with sbatch, or run jobs with cluster=slurm")
        return 0
    if args.action == "status":
        is_up, report = cluster.status(layout)
        print(report)
        return 0 if is_up else 3
    stopped = cluster.down(layout)
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0
