"""The `switchyard` command: one subcommand per concern, each a thin layer over its module."""

from __future__ import annotations

import argparse
import functools
import os
import re
import select
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from orchestrator.entry import PathError, checked, existing_dir, existing_file, new_file, shown
from orchestrator.export import command as export_command
from orchestrator.launch import local_jobs
from orchestrator.localcluster import cluster
from orchestrator.localcluster import command as cluster_command
from orchestrator.quick_exit import exit_as_interpreter
from orchestrator.terminal import one_line, printable


class Parser(argparse.ArgumentParser):
    """A usage error is one line, its values escaped: argparse printed the usage first, and echoed
    an unrecognized argument raw (an escape sequence, a newline)."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        self.exit(2, f"{self.prog}: error: {one_line(message)} (usage: {usage})\n")


def number(text: str) -> int:
    """An argparse ``type=`` for a whole number in the digits 0-9 (``int`` also takes ``７``)."""
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"{shown(text)} is invalid: write a whole number in the digits 0-9")
    return int(text)


def _verify(args: argparse.Namespace) -> int:
    from sharding.verify import run_verify_cli

    # the path and the problems come from the user and the files: shown, never obeyed
    return run_verify_cli(str(args.path), escape=printable)


def _plot(args: argparse.Namespace) -> int:
    from orchestrator.telemetry.common import TelemetryError
    from orchestrator.telemetry.plot import plot_run

    try:
        out = plot_run(args.run_dir, args.out, raw=args.raw)
    except TelemetryError as e:
        print(f"switchyard plot: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _export(args: argparse.Namespace) -> int:
    return export_command.run(args, functools.partial(_run_dir_of, registry=args.registry))


def _run_dir_of(run: str, registry: str | None) -> Path:
    """``switchyard export``'s RUN: a directory as it is, else a job of the registry (SWEEP/NUM,
    a SLURM id): its run directory."""
    from orchestrator.export.source import ExportError
    from orchestrator.registry.db import Registry, RegistryError, default_path
    from orchestrator.sweeps import status

    given = Path(run).expanduser()
    if given.is_dir():
        return given
    where = Path(registry).expanduser() if registry else default_path()
    if not where.is_file():
        raise ExportError(f"RUN={run!r} is not a directory, and there is no registry at {where} to look "
                          f"it up in: name a run directory (printed as run_dir: at start)")
    try:
        with Registry(where) as reg:
            ref = status.parse_ref(reg, run, want_job=True)
            return Path(reg.job(ref.sweep_id, ref.num or 0).run_dir)
    except (status.CommandError, RegistryError) as e:
        raise ExportError(f"RUN={run!r} is neither a directory nor a job of the registry: "
                          f"{one_line(e)}") from e


RUN_USAGE = "switchyard run [--dry-run] [key=value ...] [-m] -- COMMAND [ARG ...]"
RUN_HELP = f"""usage: {RUN_USAGE}

Run COMMAND as every rank of one job, with the cluster and parallelism groups of jobs.train
(conf/run.yaml). Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (as torchrun gives them) and SWITCHYARD_RUN_DIR; the job is in `switchyard status`.

examples:
  switchyard run -- python train.py                                   2 local ranks
  switchyard run cluster=debug -- python train.py                     1 rank, in this process
  switchyard run cluster=slurm parallelism.nodes=2 -- python train.py 2 nodes x 2 ranks on SLURM
  switchyard run --dry-run cluster=slurm -- python train.py           print the sbatch script
  switchyard run -m cluster=slurm +lr=1e-3,3e-3 -- python train.py --lr '${{lr}}'   a sweep

A script that exits 75 (switchyard.preemption.REQUEUE_EXIT_CODE) after checkpointing is requeued;
docs/your-code.md: "Your own training script"."""


def _run(argv: Sequence[str]) -> int:
    """``switchyard run``: everything before ``--`` goes to Hydra, everything after is the command."""
    from orchestrator.scripts import job
    from orchestrator.scripts.schema import refuse_unparsable
    from orchestrator.terminal import refuse_control

    if refused := refuse_control(["run", *argv]):
        print(f"switchyard run: error: {refused}", file=sys.stderr)
        return 2
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            print(RUN_HELP)
            return 0
        print(f"switchyard run: error: no command: put it after `--` ({RUN_USAGE})", file=sys.stderr)
        return 2
    split = list(argv).index("--")
    overrides, command = list(argv[:split]), list(argv[split + 1:])
    overrides = ["cluster.dry_run=true" if o == "--dry-run" else o for o in overrides]
    if refused := refuse_unparsable(command):
        print(f"switchyard run: error: {one_line(refused)}", file=sys.stderr)
        return 2
    return job.main(overrides, command)


def _sweeps(args: argparse.Namespace) -> int:
    """status, logs, show, cancel, resubmit: each a thin call into orchestrator.sweeps.status."""
    from orchestrator.registry.db import Registry, damage_reported
    from orchestrator.sweeps import status

    with Registry(args.registry) as reg, damage_reported(reg.path):
        if args.command == "status" and _is_search(reg, args.target):
            from orchestrator.search import view

            return view.cmd_status(reg, int(args.target), args.json)
        if args.command == "status":
            return status.cmd_status(reg, args.target, args.json)
        if args.command == "logs":
            return status.cmd_logs(reg, args.job, args.rank, args.follow, args.stream, args.attempt)
        if args.command == "show":
            return status.cmd_show(reg, args.job, args.json)
        if args.command == "cancel":
            return status.cmd_cancel(reg, args.target, args.json, grace_s=args.grace)
        if args.command == "snapshots":
            from orchestrator.sweeps import prune

            return prune.cmd_prune(reg, args.store, args.older_than_days, args.dry_run, args.json)
        return status.cmd_resubmit(reg, args.target, args.failed, args.json)


def _is_search(registry: object, target: str | None) -> bool:
    from orchestrator.registry.db import Registry
    from orchestrator.search import view

    return isinstance(registry, Registry) and view.is_search(registry, target)


def _search(args: argparse.Namespace) -> int:
    """best, search resume: thin calls into orchestrator.search.view."""
    from orchestrator.registry.db import Registry, damage_reported
    from orchestrator.search import view

    with Registry(args.registry) as reg, damage_reported(reg.path):
        if args.command == "best":
            return view.cmd_best(reg, args.sweep, args.json)
        return view.cmd_resume(reg, args.sweep)


def _add_search_commands(sub: argparse._SubParsersAction[Parser], common: Parser, scripted: Parser) -> None:
    p = sub.add_parser("best", parents=[common, scripted],
                       help="a search's best trial: its overrides, ready to paste, and its run directory")
    p.add_argument("sweep", type=int, metavar="SEARCH")
    p.set_defaults(func=_search)
    p = sub.add_parser("search", parents=[common], help="a hyperparameter search: resume a killed controller")
    p.add_argument("action", choices=["resume"])
    p.add_argument("sweep", type=int, metavar="SEARCH")
    p.set_defaults(func=_search)


def _add_sweep_commands(sub: argparse._SubParsersAction[Parser]) -> None:
    common = Parser(add_help=False)
    registry_file = functools.partial(existing_file, what="a sweep registry (without --registry: "
                                                          "$SWITCHYARD_REGISTRY or the default one)")
    common.add_argument("--registry", default=None, type=checked(registry_file),
                        help="the sweep registry (default $SWITCHYARD_REGISTRY or "
                             "~/.local/share/switchyard/registry.db)")
    scripted = Parser(add_help=False)
    scripted.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("status", parents=[common, scripted],
                       help="sweeps; with SWEEP, each job's state, step, loss and runtime")
    p.add_argument("target", nargs="?", metavar="SWEEP", help="a sweep id (or SWEEP/NUM for one job)")
    # every call reads every ended job now; the flag of the calls that read for a second is still
    # taken, so the scripts that pass it run on
    p.add_argument("--read-all", action="store_true", help=argparse.SUPPRESS)
    p = sub.add_parser("logs", parents=[common], help="a job's log (one rank), optionally followed")
    p.add_argument("job", metavar="JOB", help="SWEEP/NUM (e.g. 3/0) or a SLURM id (e.g. 4711_0)")
    p.add_argument("--rank", type=number, default=0, help="which rank's log (default 0)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--stream", choices=["both", "out", "err"], default="both",
                   help="stdout, stderr or both (default)")
    p.add_argument("--attempt", type=number, default=None, help="an earlier attempt (default: latest)")
    p = sub.add_parser("show", parents=[common, scripted], help="a job's overrides, attempts and "
                                                                "resolved config")
    p.add_argument("job", metavar="JOB", help="SWEEP/NUM or a SLURM id")
    p = sub.add_parser("cancel", parents=[common, scripted], help="cancel a sweep's jobs, or one job")
    p.add_argument("target", metavar="SWEEP|JOB")
    p.add_argument("--grace", type=float, default=local_jobs.KILL_WAIT_S, metavar="SECONDS",
                   help="local jobs: seconds between SIGTERM (the trainer checkpoints) and SIGKILL "
                        "(default %(default)g, SLURM's KillWait); SLURM jobs follow the cluster's KillWait")
    p = sub.add_parser("resubmit", parents=[common, scripted],
                       help="submit a sweep's failed, timed-out and cancelled jobs again, as a new array")
    p.add_argument("target", metavar="SWEEP")
    p.add_argument("--failed", action="store_true", help="the jobs whose latest attempt did not complete")
    p = sub.add_parser("snapshots", parents=[common, scripted],
                       help="the code snapshot store: prune removes the snapshots no job still needs")
    p.add_argument("action", choices=["prune"])
    p.add_argument("--older-than-days", type=float, default=30.0, metavar="DAYS",
                   help="keep the snapshots of sweeps from the last DAYS days, and any taken or reused "
                        "since; jobs not yet ended keep theirs however old (default %(default)g)")
    store_dir = functools.partial(existing_dir, what="a snapshot store")
    p.add_argument("--store", default=None, type=checked(store_dir),
                   help="the store (default: cluster.snapshot.dir's, ~/.cache/switchyard/snapshots)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    for name in ("status", "logs", "show", "cancel", "resubmit", "snapshots"):
        sub.choices[name].set_defaults(func=_sweeps)
    _add_search_commands(sub, common, scripted)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="switchyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", help="a real SLURM cluster on this machine (2 nodes, accounting)")
    cluster_command.add_arguments(p)
    p.set_defaults(func=cluster_command.run)

    p = sub.add_parser("verify", help="check a sharded dataset: structure and every file's checksum")
    p.add_argument("path", type=checked(functools.partial(existing_dir, what="a dataset directory")),
                   help="the dataset directory (the one holding manifest.json)")
    p.set_defaults(func=_verify)

    p = sub.add_parser("plot", help="memory over time per GPU (or per rank on CPU) as a PNG")
    p.add_argument("run_dir", type=checked(functools.partial(existing_dir, what="a run directory")),
                   help="the run directory (printed as run_dir: at start)")
    p.add_argument("--out", default=None, type=checked(new_file),
                   help="PNG path (default RUN/telemetry/memory.png)")
    p.add_argument("--raw", action="store_true",
                   help="draw every sample (default: the sampler's downsampled series, at most 1024 "
                        "points per node, each the peak of the samples it stands for)")
    p.set_defaults(func=_plot)

    sub.add_parser("run", help="any command as every rank of a job: " + RUN_USAGE, add_help=False)

    p = sub.add_parser("export", help="a checkpoint as a Hugging Face directory or safetensors, "
                                      "reloaded and verified", epilog=export_command.EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    export_command.add_arguments(p)
    p.set_defaults(func=_export)

    _add_sweep_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["run"]:  # Hydra parses its overrides (-m included), argparse never sees them
        return _run(given[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except cluster.ClusterError as e:
        print(f"switchyard {args.command}: error: {printable(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        from orchestrator.sweeps import status

        if not isinstance(e, (*status.ERRORS, *_search_errors(), PathError)):
            raise
        print(f"switchyard {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


def _closed(stream: object) -> bool:
    """Whether ``stream`` is a pipe nobody reads any more (the kernel flags its write end)."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)  # type: ignore[attr-defined]
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def main_to_a_reader_that_may_leave(argv: Sequence[str] | None = None) -> int:
    """``main``, and a reader that stops reading (``switchyard status 1 | head -1``) ends it
    quietly, as Python's documentation recommends (``signal``, "Note on SIGPIPE"): what is left
    to write goes to /dev/null, exit 1, no BrokenPipeError traceback. A broken pipe that is not
    the output's (a socket) is an error as before."""
    try:
        try:
            return main(argv)
        finally:  # here, not at exit (argparse's --help exits): a closed reader is seen while it can be
            sys.stdout.flush()  # handled
    except BrokenPipeError:
        gone = [s for s in (sys.stdout, sys.stderr) if _closed(s)]
        if not gone:
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in gone:
            os.dup2(devnull, stream.fileno())  # the flush at exit writes nowhere instead of failing
        return 1


def _search_errors() -> tuple[type[Exception], ...]:
    from orchestrator.config import ConfigError
    from orchestrator.search.controller import SearchError

    return (SearchError, ConfigError)


def console_main() -> NoReturn:
    """The installed ``switchyard`` command: ``main``, ending as the interpreter would but without
    its teardown (``quick_exit``): ``switchyard run`` waits on its job and has printed its end."""
    exit_as_interpreter(lambda: sys.exit(main_to_a_reader_that_may_leave()), join_threads=True)


if __name__ == "__main__":
    console_main()
