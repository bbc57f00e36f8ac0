"""The `switchyard` command: one subcommand per concern, each a thin layer over its module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from orchestrator.localcluster import cluster


def _cluster(args: argparse.Namespace) -> int:
    layout = cluster.Layout.from_env(args.state_dir)
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


def _verify(args: argparse.Namespace) -> int:
    from sharding.verify import run_verify_cli

    return run_verify_cli(args.path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", help="a real SLURM cluster on this machine (2 nodes, accounting)")
    p.add_argument("action", choices=["up", "status", "down"])
    p.add_argument("--state-dir", default=None,
                   help=f"where config, logs, pid files and the database live "
                        f"(default ${cluster.STATE_DIR_ENV} or {cluster.DEFAULT_STATE_DIR})")
    p.add_argument("--no-install", action="store_true",
                   help="fail instead of installing missing Debian packages")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="how long up waits for the nodes to become idle")
    p.set_defaults(func=_cluster)

    p = sub.add_parser("verify", help="check a sharded dataset: structure and every file's checksum")
    p.add_argument("path", help="the dataset directory (the one holding manifest.json)")
    p.set_defaults(func=_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except cluster.ClusterError as e:
        print(f"switchyard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
