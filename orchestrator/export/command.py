"""``switchyard export RUN [--step N] --format hf|safetensors OUT``, and ``python -m
orchestrator.export`` (the same arguments, plus the in-training exporter's ``--checkpoint``).

Exit 0: published and verified; 2: bad input (one ``error:`` line naming the value and the fix,
before anything is written); 1: the export did not reload to the checkpoint's logits (nothing
published).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from orchestrator.config import EXPORT_FORMATS
from orchestrator.terminal import one_line

EXAMPLES = """examples:
  switchyard export outputs/2026-12-02/10-00-00 --format hf exported/gpt
  switchyard export 3/0 --step 400 --format safetensors exported/step-400"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a run directory (printed as run_dir: at start), or a job "
                                              "of the registry: SWEEP/NUM or its SLURM id")
    p.add_argument("out", metavar="OUT", type=Path, help="the directory to write (new, or empty)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, dest="fmt",
                   help="hf: a save_pretrained directory; safetensors: model.safetensors + its config")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it holds anything")
    p.add_argument("--max-shard-mb", type=float, default=5000, metavar="MB",
                   help="hf: at most MB per safetensors file, then an index (default %(default)s)")
    p.add_argument("--registry", default=None,
                   help="the registry RUN is looked up in (default $SWITCHYARD_REGISTRY or "
                        "~/.local/share/switchyard/registry.db)")
    p.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)  # in-training: staged
    p.add_argument("--recorded-as", type=Path, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace, run_dir_of: Callable[[str], Path] | None = None) -> int:
    """``run_dir_of``: RUN -> its run directory (the CLI looks a job up in the registry); without
    it RUN must be a directory."""
    from orchestrator.export.exporter import VerificationError, export
    from orchestrator.export.source import ExportError

    try:
        if args.step is not None and args.step < 0:
            raise ExportError(f"--step {args.step}: a step is >= 0 (try the newest: leave --step out)")
        if not args.max_shard_mb > 0:
            raise ExportError(f"--max-shard-mb {args.max_shard_mb}: must be > 0 (try --max-shard-mb 5000)")
        run_dir = run_dir_of(args.run) if run_dir_of is not None else Path(args.run)
        record = export(run_dir, args.fmt, args.out, step=args.step, checkpoint_path=args.checkpoint,
                        recorded_as=args.recorded_as, overwrite=args.overwrite, shard_mb=args.max_shard_mb)
    except ExportError as e:
        print(f"switchyard export: error: {one_line(e)}", file=sys.stderr)
        return 2
    except VerificationError as e:
        print(f"switchyard export: failed: {one_line(e)}", file=sys.stderr)
        return 1
    diff = record["max_abs_diff"]
    print(f"{record['path']}\nstep {record['step']} of {record['checkpoint']} as {args.fmt} "
          f"({record['class']}); reloaded and compared: max |logit diff| "
          f"{'n/a' if diff is None else f'{diff:.3g}'}, {record['verification']['parameters']:,} parameters; "
          f"peak host memory {record['peak_host_bytes'] / 2**20:,.0f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchyard export", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
