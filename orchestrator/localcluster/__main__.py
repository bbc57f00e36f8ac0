"""``python3 -m orchestrator.localcluster up|status|down``: ``switchyard cluster`` without the
virtual environment (``command``'s docstring says why)."""

from __future__ import annotations

import argparse
import sys

from orchestrator.localcluster import cluster, command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m orchestrator.localcluster",
                                     description="a real SLURM cluster on this machine (2 nodes, accounting)")
    command.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return command.run(args)
    except cluster.ClusterError as e:
        print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
