"""Forked ranks: a local job's controller imports what every rank needs once, then forks its ranks.

``cluster=local`` runs submitit's local controller, which starts each rank as a fresh
``python -u -m submitit.core._submit FOLDER``: every rank imports torch, Switchyard, the job's
modules and the ``torch._dynamo`` that DDP's constructor pulls in, all the same files, once per
rank (issue 39). Here the controller is submitit's own (its timeout signal, requeue loop and
signal forwarding unchanged), but before its first start it imports the job's rank modules
(``preload``), and each start forks the ranks from that state instead of starting interpreters.
A forked rank then runs exactly what the started one ran (``submission.process_job``, with the
same ``SUBMITIT_LOCAL_*`` variables, its own ``JOB_RANK_log.out/.err`` on its fds 1 and 2,
unbuffered as ``-u`` makes them), so its result file, its stop file, its log and its exit code,
which the submitting side reads, are what they were.

A fork is only safe from a process that has started nothing the children would share: no CUDA
context (a child of a process with one cannot use CUDA), no thread (one holding a lock at the fork
leaves it held forever in every child: the OpenMP and intra-op pools start at the first parallel
tensor op, never at import), no process group. The controller checks all three after its imports
and otherwise starts the ranks as submitit does, saying why on its stderr. The ranks seed their
generators themselves after the fork (``runtime.seed_everything``), as they did.

On SLURM srun starts every rank (``cluster.rank_start=auto`` spawns there): a node launcher for
SLURM is designed in docs/performance.md and not built.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import submitit
from submitit.core import submission, utils
from submitit.local.local import Controller, LocalJob

from orchestrator import atomic
from orchestrator.launch import local_jobs

MODULE = "orchestrator.launch.fork_start"
PRELOAD_ENV = "SWITCHYARD_RANK_PRELOAD"  # the modules to import before forking, comma-separated
# numpy's OpenBLAS starts its thread pool at import, and torch's import GNU OpenMP's, one thread
# per core, unless these say 1. The controller starts with them at 1 (the user's values saved in
# USERS_THREAD_VARS) and puts the user's back after its imports, for the ranks: they size their
# own pools after the fork (runtime.thread_budget), as a started rank does.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
USERS_THREAD_VARS = "SWITCHYARD_USERS_THREAD_VARS"
SUBMIT_SCRIPT = str(Path(submission.__file__).with_name("_submit.py"))  # a started rank's sys.argv[0]


class ForkingLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose controller is this module: the same parameters, job and
    files; only the ranks' start differs."""

    def __init__(self, folder: Path, preload: Sequence[str]) -> None:
        super().__init__(folder=folder)
        self.preload = tuple(preload)

    def _submit_command(self, command: str) -> LocalJob[Any]:
        ntasks = self.parameters.get("tasks_per_node", 1)
        n_gpus = self.parameters.get("gpus_per_node", 0)
        visible = self.parameters.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        setup = self.parameters.get("setup", ())
        env = {**os.environ,  # what submitit's start_controller sets, and the modules to preload
               "SUBMITIT_LOCAL_NTASKS": str(ntasks), "SUBMITIT_LOCAL_COMMAND": command,
               "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
               "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
               "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
               "SUBMITIT_STDERR_TO_STDOUT": "1" if self.parameters.get("stderr_to_stdout") else "",
               "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in gpus),
               "SUBMITIT_LOCAL_WITH_SHELL": "1" if setup else "", PRELOAD_ENV: ",".join(self.preload),
               **dict.fromkeys(THREAD_VARS, "1"),
               USERS_THREAD_VARS: json.dumps({k: os.environ.get(k) for k in THREAD_VARS})}
        argv = [sys.executable, "-m", MODULE, str(self.folder)]
        process = subprocess.Popen(" && ".join([*setup, shlex.join(argv)]) if setup else argv,
                                   shell=bool(setup), env=env)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                        tasks=list(range(ntasks)))


class ForkedTask:
    """A forked rank, as submitit's controller uses a ``Popen``: ``poll`` and ``send_signal``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:  # a signal reads as -N, as Popen.returncode has it
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never a reaped pid, which the system may have given another process
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


class ForkingController(Controller):
    """submitit's local controller, starting its tasks by fork once ``preload`` is imported."""

    def __init__(self, folder: Path, preload: Sequence[str]) -> None:
        super().__init__(folder)
        self.unsafe = why_not_fork(preload)
        if self.unsafe and preload:
            print(f"switchyard: ranks start as new processes, not forked: {self.unsafe}",
                  file=sys.stderr, flush=True)

    def start_tasks(self) -> None:
        if self.unsafe:
            super().start_tasks()
            return
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        await_pickle(paths[0].submitted_pickle)
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        forked: dict[int, int] = {}
        for k in range(self.ntasks):
            sys.stdout.flush()  # nothing of the controller's is written again by a child
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_rank(k, self.pid, self.folder, self.stdouts[k], self.stderrs[k])
            self.tasks.append(ForkedTask(pid))  # type: ignore[arg-type]  # poll and send_signal
            forked[pid] = k
        atomic.write_json(local_jobs.forked_ranks_file(self.folder, os.getpid()), forked, durable=False)


def await_pickle(path: Path, timeout_s: float = 60.0) -> None:
    """The submitter renames the job's pickle into place once the controller has started. A
    started rank met it after seconds of imports; a forked one would sleep a whole second in
    submitit's wait for it: so the controller waits, in short polls, for up to submitit's minute
    (past it, the ranks fail in submitit's wait as before)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def why_not_fork(preload: Sequence[str]) -> str | None:
    """Import ``preload``; None if a fork from here is safe, else what makes it unsafe."""
    try:
        if not preload:
            return "this job names no modules to import first"
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as e:  # the rank will meet it again, and report it as today
                return f"importing {name} failed ({type(e).__name__}: {e})"
    finally:
        restore_thread_vars()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA, which a forked child cannot use"
    tasks = Path("/proc/self/task")
    threads = len(os.listdir(tasks)) if tasks.is_dir() else threading.active_count()  # C threads too
    if threads > 1:
        return (f"an import started {threads - 1} thread(s), which a fork would leave in every "
                f"child without them")
    return None


def restore_thread_vars() -> None:
    """The user's ``THREAD_VARS`` again (unset where they were), once the imports are done."""
    saved = json.loads(os.environ.pop(USERS_THREAD_VARS, "{}"))
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run_rank(local_id: int, job_id: str, folder: Path, stdout: IO[Any], stderr: IO[Any]) -> None:
    """In the forked child: become the rank submitit would have started, run it, exit as it would."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the controller's forwarding is not the rank's
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        sys.stdout, sys.stderr = unbuffered(1), unbuffered(2)  # as `python -u` started it
        os.environ.update(SUBMITIT_LOCAL_LOCALID=str(local_id), SUBMITIT_LOCAL_GLOBALID=str(local_id),
                          SUBMITIT_LOCAL_JOB_ID=job_id)
        sys.argv = [SUBMIT_SCRIPT, str(folder)]
        modules = os.environ.get(PRELOAD_ENV, "").replace(",", ", ")
        print(f"switchyard: rank process forked from the job's controller (pid {os.getppid()}), "
              f"which imported {modules} once for every rank", flush=True)
        submission.process_job(folder)
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:  # as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's own exit runs (torch's, logging's)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives a process: 0 for None, the int, else 1 (printed)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {MODULE} SUBMITIT_FOLDER")
    preload = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    ForkingController(Path(sys.argv[1]), preload).run()


if __name__ == "__main__":
    main()
