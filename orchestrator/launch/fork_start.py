"""Forked ranks: one process per node imports what every rank needs once, then forks its ranks.

Started ranks each import torch, Switchyard, the job's modules and the ``torch._dynamo`` that DDP's
constructor pulls in: the same files, once per rank (issue 39). Forked, they are imported once per
node, and a rank then runs exactly what a started one ran (``submission.process_job``, with the
variables it would have had, its own ``JOB_RANK_log.out/.err`` on its fds 1 and 2, unbuffered as
``-u`` makes them), so its result file, its stop file, its log and its exit code, which the
submitting side reads, are what they were.

- ``cluster=local``: submitit's local controller, which started each rank as a fresh ``python -u -m
  submitit.core._submit FOLDER``, is subclassed (``ForkingController``: its timeout signal, requeue
  loop and signal forwarding unchanged); before its first start it imports the job's rank modules
  and each start forks the ranks (``ForkingLocalExecutor``).
- ``cluster=slurm``: srun starts one task per node, the node launcher (``node_launcher``), which
  imports once, forks the node's ranks with the variables srun would have given them, and reports
  a rank's death the way srun did (``ForkingSlurmExecutor`` writes that srun line, for a single
  job or a sweep's array).

A local job's controller is itself forked where it can be (``ControllerTemplate``): ``python -m
jobs.train`` forks a template of itself once its imports are done and before it does anything
else, and the first local job it submits makes that template its controller, which then imports
only what its ranks need beyond the submitter's imports. A new ``python -m`` controller imported
torch and Switchyard again (about 3 s of CPU, before any rank started). The template is the
submitter's child, as submitit's ``Popen`` was; it takes the submitter's environment, working
directory and stdout/stderr as they are at the submission, so it is the controller a new
process would have been. Where the submitter has no template (it has a thread or a CUDA context,
another job already took it, the job runs setup lines in a shell), the controller is started as
before.

When a fork is not safe (``fork_safety``: a thread, a CUDA context), the ranks start as new
processes and the reason is said on stderr. The ranks seed their generators themselves after the
fork (``runtime.seed_everything``), as they did.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import submitit
from submitit.core import submission, utils
from submitit.local.local import Controller, LocalJob
from submitit.slurm import slurm

from durable import atomic
from orchestrator.launch import job_entry, local_jobs, restarts
from orchestrator.launch.fork_safety import (
    PRELOAD_ENV,
    THREAD_VARS,
    USERS_THREAD_VARS,
    why_not_fork,
    why_not_fork_now,
)
from orchestrator.quick_exit import exit_as_interpreter

MODULE = "orchestrator.launch.fork_start"
LAUNCHER_MODULE = "orchestrator.launch.node_launcher"  # the SLURM node launcher (not imported here)


class ForkingLocalExecutor(job_entry.EntryCommand, submitit.LocalExecutor):
    """submitit's LocalExecutor whose controller is this module: the same parameters, job and
    files; only the ranks' start differs (a rank started where a fork is unsafe: ``job_entry``)."""

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
        template = None if setup else take_template()
        process: Any = None
        if template is not None:
            with contextlib.suppress(OSError):  # the template is gone (killed): start one instead
                process = template.become_controller(self.folder, env)
        if process is None:
            argv = [sys.executable, "-m", MODULE, str(self.folder)]
            process = subprocess.Popen(" && ".join([*setup, shlex.join(argv)]) if setup else argv,
                                       shell=bool(setup), env=env)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                        tasks=list(range(ntasks)))


class ForkingSlurmExecutor(job_entry.Restarting):
    """submitit's SlurmExecutor whose srun starts one task per node: the node launcher, which
    imports ``preload`` once and forks the node's ranks. The ``#SBATCH`` header is unchanged (the
    allocation: its tasks, their CPUs, GPUs and memory, the ranks' log files); only the srun line
    differs: one task per node with every CPU of the node's ranks, and the launcher's own logs
    (``JOB_NODE_launcher.out/.err``), so it never writes into a rank's."""

    def __init__(self, folder: Path, preload: Sequence[str], max_num_timeout: int = 0,
                 python: str | None = None) -> None:
        super().__init__(folder=folder, max_num_timeout=max_num_timeout, python=python)
        self.preload = tuple(preload)

    @property
    def ranks_per_node(self) -> int:
        return max(1, int(self.parameters.get("ntasks_per_node", 1)))

    @property
    def _submitit_command_str(self) -> str:
        return " ".join([self.python, "-u -m", LAUNCHER_MODULE, shlex.quote(str(self.folder)),
                         str(self.ranks_per_node), shlex.quote(",".join(self.preload))])

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]
                                      ) -> list[submitit.Job[Any]]:
        """One job as submitit submits it; an array (a sweep's points) as submitit's own array path
        does, except that the copy it submits from is this class, so the script is this one's."""
        if len(delayed_submissions) == 1:
            return super()._internal_process_submissions(delayed_submissions)
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            pickle = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            delayed.dump(pickle)
            pickles.append(pickle)
        array = ForkingSlurmExecutor(self.folder, self.preload, self.max_num_timeout, python=self.python)
        array.restarts = self.restarts
        array.update_parameters(**self.parameters)
        array.parameters["map_count"] = len(pickles)
        self._throttle()
        first = array._submit_command(self._submitit_command_str)
        tasks = list(range(first.num_tasks))
        jobs: list[submitit.Job[Any]] = [submitit.SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{a}",
                                                           tasks=tasks) for a in range(len(pickles))]
        for job, pickle in zip(jobs, pickles, strict=True):
            job.paths.move_temporary_file(pickle, "submitted_pickle")
        return jobs

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        params = dict(self.parameters)
        cpus = params.get("cpus_per_task")
        logs = str(self.folder / "%j_%t_launcher")
        if "map_count" in params:  # an array task's files are named ARRAY_TASK, as submitit names its
            logs = logs.replace("%j", "%A_%a")
        params["srun_args"] = [*params.get("srun_args", []), f"--ntasks={params.get('nodes', 1)}",
                               "--ntasks-per-node=1",
                               *([f"--cpus-per-task={int(cpus) * self.ranks_per_node}"] if cpus else []),
                               "--output", f"{logs}.out", "--error", f"{logs}.err"]
        return restarts.wrap(slurm._make_sbatch_string(command=command, folder=self.folder, **params),
                             self.restarts, self.folder)


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
        # The ranks wait at this gate until the list of them is written: a rank at work is always
        # one that local_jobs.ranks can name (the fail-fast wait, `switchyard cancel`, rank ends).
        gate = os.pipe()
        try:
            for k in range(self.ntasks):
                sys.stdout.flush()  # nothing of the controller's is written again by a child
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    pass_gate(gate)
                    run_rank(k, self.pid, self.folder, self.stdouts[k], self.stderrs[k])
                self.tasks.append(ForkedTask(pid))  # type: ignore[arg-type]  # poll and send_signal
                forked[pid] = k
            atomic.write_json(local_jobs.forked_ranks_file(paths[0].folder, os.getpid()), forked,
                              durable=False)
        finally:
            for fd in gate:  # the write end's last copy closes: every rank passes
                os.close(fd)


class ControllerTemplate:
    """A child forked from a submitting process that has imported and done nothing else, waiting
    to become the first local job's controller (``become_controller``). It exits, unused, once
    the submitter releases it (``release_template``) or ends: the end of its socket closes."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def fork(cls) -> ControllerTemplate | None:
        """The template, or None where a fork from here is not safe."""
        if why_not_fork_now() is not None:
            return None
        ours, its = socket.socketpair()
        sys.stdout.flush()  # nothing buffered here is written again by the child
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            serve_once(its)
        its.close()
        return cls(pid, ours)

    def become_controller(self, folder: Path, env: dict[str, str]) -> ForkedTask:
        """Hand the template the controller's environment, this process's working directory and
        its stdout and stderr as they are now; -> the controller, as submitit polls and signals it."""
        request = json.dumps({"folder": str(folder), "env": env, "cwd": os.getcwd()}).encode()
        try:
            socket.send_fds(self.sock, [len(request).to_bytes(8, "big")], [1, 2])
            self.sock.sendall(request)
        except OSError:  # it has exited: reap it, and the caller starts a controller
            self.release()
            raise
        self.sock.close()
        return ForkedTask(self.pid)

    def release(self) -> None:
        self.sock.close()  # the template reads the end of its socket and exits
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


_TEMPLATE: ControllerTemplate | None = None


def fork_template() -> None:
    """Fork this process's controller template, where a fork is safe (``ControllerTemplate``)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        _TEMPLATE = ControllerTemplate.fork()


def take_template() -> ControllerTemplate | None:
    """The template for a local job's controller, once: a second job's controller is started."""
    global _TEMPLATE
    template, _TEMPLATE = _TEMPLATE, None
    return template


def release_template() -> None:
    """No local job will use the template (a SLURM or debug run): it exits now."""
    template = take_template()
    if template is not None:
        template.release()


def serve_once(sock: socket.socket) -> NoReturn:
    """In the template: wait for the request, then run as ``python -m`` this module would, with
    the request's environment, working directory, stdout and stderr. Never returns."""
    try:
        os.closerange(3, sock.fileno())  # what the submitter had open, as Popen's close_fds
        os.closerange(sock.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
        head, fds, _, _ = socket.recv_fds(sock, 8, 2)
        while 0 < len(head) < 8:
            head += sock.recv(8 - len(head))
        size = int.from_bytes(head, "big") if len(head) == 8 and len(fds) == 2 else 0
        body = b""
        while len(body) < size and (more := sock.recv(size - len(body))):
            body += more
    except BaseException:  # the submitter went away or was interrupted: nothing to become
        os._exit(0)
    if not size or len(body) < size:
        os._exit(0)  # released

    def controller() -> None:
        sock.close()
        request = json.loads(body)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [str(Path(__file__)), request["folder"]]
        name_process(local_jobs.FORKED_CONTROLLER)
        main()

    exit_as_interpreter(controller)


def name_process(name: str) -> None:
    """This process's name as ``ps -o comm`` and psutil's ``name()`` show it (15 characters)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


def await_pickle(path: Path, timeout_s: float = 60.0) -> None:
    """The submitter renames the job's pickle into place once the controller has started. A
    started rank met it after seconds of imports; a forked one would sleep a whole second in
    submitit's wait for it: so the controller waits, in short polls, for up to submitit's minute
    (past it, the ranks fail in submitit's wait as before)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def pass_gate(gate: tuple[int, int]) -> None:
    """In a forked child: wait until the controller closes the gate's write end (EOF), having
    listed its ranks. Each child closes its own copy of that end first, or EOF would never come."""
    read_end, write_end = gate
    with contextlib.suppress(OSError):
        os.close(write_end)
        os.read(read_end, 1)
        os.close(read_end)


def run_rank(local_id: int, job_id: str, folder: Path, stdout: IO[Any], stderr: IO[Any]) -> NoReturn:
    """In a local job's forked child: become the rank submitit's controller would have started."""
    become_rank(folder, {"SUBMITIT_LOCAL_LOCALID": str(local_id), "SUBMITIT_LOCAL_GLOBALID": str(local_id),
                         "SUBMITIT_LOCAL_JOB_ID": job_id}, stdout.fileno(), stderr.fileno(),
                f"the job's controller (pid {os.getppid()})")


def become_rank(folder: Path, env: dict[str, str], stdout_fd: int, stderr_fd: int, parent: str) -> NoReturn:
    """In the forked child: the variables a started rank would have had (``env``), its log files on
    fds 1 and 2, then submitit's ``process_job``; exit as the interpreter would. Never returns."""

    def rank() -> None:
        for signum in (signal.SIGTERM, signal.SIGUSR2):  # the parent's handling is not the rank's
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        name_process(Path(sys.executable).name)  # a started rank's name, not a forked controller's
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        sys.stdout, sys.stderr = unbuffered(1), unbuffered(2)  # as `python -u` started it
        os.environ.update(env)
        sys.argv = [job_entry.SUBMIT_SCRIPT, str(folder)]
        modules = os.environ.get(PRELOAD_ENV, "").replace(",", ", ")
        print(f"switchyard: rank process forked from {parent}, which imported {modules} once for "
              f"every rank", flush=True)
        submission.process_job(folder)

    exit_as_interpreter(rank)


def unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m {MODULE} SUBMITIT_FOLDER")
    preload = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    ForkingController(Path(sys.argv[1]), preload).run()


if __name__ == "__main__":  # a started controller: it ends as a forked one does, without the teardown
    exit_as_interpreter(main, join_threads=True)
