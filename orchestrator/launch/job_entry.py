"""A job's process whose code is all Switchyard's: ``python -u -m orchestrator.launch.job_entry FOLDER``.

submitit starts each task of a job as ``python -u -m submitit.core._submit FOLDER``, which runs
``submission.process_job`` and returns, and the interpreter then tears down every module the job
imported: half a second of CPU per process that imported torch (0.55 s measured for
``torch.distributed`` and submitit on the 2-core test machine, 0.05 s without torch), on every
rank of every job. This entry runs the same ``process_job`` and leaves as that process would (the
same exit status, traceback, ``atexit`` functions, non-daemon threads joined, output flushed)
without the teardown (``quick_exit.exit_as_interpreter``, as the forked ranks leave).

Its jobs are those whose process runs Switchyard's code and the user's model only:
``jobs.train``'s started ranks (and the controllers' fallback when a fork is unsafe) and
``switchyard run``'s rank wrappers, whose command is a process of its own. A job that runs the
user's own Python function in its process (``switchyard submit``, a plain Hydra app's sweep
points) keeps submitit's entry: the teardown is what flushes a file the function left open.

The job sees the ``sys.argv`` submitit's entry gives it, as a forked rank does.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import NoReturn

import submitit
from submitit.core import submission

from orchestrator.launch import restarts
from orchestrator.quick_exit import exit_as_interpreter

MODULE = "orchestrator.launch.job_entry"
SUBMIT_SCRIPT = str(Path(submission.__file__).with_name("_submit.py"))  # a job's sys.argv[0]


def command(python: str, folder: Path) -> str:
    """The shell command that runs one task of the job in ``folder`` (``python``: quoted already,
    or a container's command ending in its python)."""
    return " ".join([python, "-u -m", MODULE, shlex.quote(str(folder))])


class EntryCommand:
    """An executor whose tasks start through this module instead of submitit's ``_submit``; the
    rest (the sbatch header, srun, arrays, the local controller) is submitit's."""

    python: str
    folder: Path

    @property
    def _submitit_command_str(self) -> str:
        return command(self.python, self.folder)


class LocalExecutor(EntryCommand, submitit.LocalExecutor):
    pass


class Restarting(submitit.SlurmExecutor):
    """A SLURM executor whose batch script restarts its job step inside the allocation, up to
    ``restarts`` times (``restarts.wrap``; 0: submitit's script as it is)."""

    restarts: int = 0

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return restarts.wrap(super()._make_submission_file_text(command, uid), self.restarts, self.folder)


class SlurmExecutor(EntryCommand, Restarting):
    pass


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(f"usage: python -m {MODULE} SUBMITIT_FOLDER")
    folder = args[0]
    sys.argv = [SUBMIT_SCRIPT, folder]
    exit_as_interpreter(lambda: submission.process_job(folder), join_threads=True)


if __name__ == "__main__":
    main()
