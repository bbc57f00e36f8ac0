"""The SLURM node launcher: one srun task per node imports what every rank needs once, then forks
the node's ranks (issue 39; ``fork_start.ForkingSlurmExecutor`` writes its srun line).

srun used to start every rank, so N ranks per node imported the same files N times, from a shared
file system at that. Here each rank is forked with the variables srun would have given it
(``Layout.rank_env``), then runs submitit's ``process_job`` exactly as a started rank did: the same
result, stop and log files. What srun did for the ranks as its tasks, the launcher does:

- **a rank's death is reported in srun's words** ("switchyard launcher: error: n2: task 3:
  Killed", or "Exited with exit code 1"), in the batch script's stderr where srun writes its own
  lines, then "switchyard launcher: stopping ...": what follows is a consequence, as what follows
  srun's "Terminating StepId" is (``bad_nodes.srun_errors`` reads both);
- **the node's other ranks are stopped** (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and the launcher
  exits with the failed rank's status, so srun's ``--kill-on-bad-exit`` stops the other nodes; a
  rank that left on a stop request (preemption, the time limit) stops nobody: the others left at
  the same step;
- **signals**: SLURM signals every process of the step (on the local cluster ``scancel --signal``'s
  USR2 and TERM reach the forked ranks themselves), so the launcher forwards nothing; it notes
  them and waits for its ranks, which stop at a step boundary as before;
- **no orphans**: each forked rank asks the kernel for SIGKILL when its launcher dies
  (``PR_SET_PDEATHSIG``), so a launcher killed outright takes its ranks with it.

Where a fork is not safe (``fork_safety``), the ranks start as new interpreters, supervised the same.
Only the standard library is imported before ``hold_thread_pools``: submitit's ``submission`` module
imports numpy, whose OpenBLAS would start its thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.launch import dist_env
from orchestrator.launch.fork_safety import PRELOAD_ENV, hold_thread_pools, why_not_fork

MODULE = "orchestrator.launch.node_launcher"
SAYS = "switchyard launcher"  # how its lines start; bad_nodes reads them
STOP_GRACE_S = 10.0  # after a rank failed, the others' time to leave on SIGTERM before SIGKILL
POLL_S = 0.05  # while the others are given their grace
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Layout:
    """Where this launcher's ranks sit in the job: it is task ``node`` of ``nodes`` (one per node)."""

    node: int
    nodes: int
    per_node: int
    hostname: str
    job_id: str  # as submitit names the job's files (an array task's: ARRAY_TASK)
    cpus_per_task: int | None  # the launcher's CPUs (every rank's), when SLURM says

    @classmethod
    def from_env(cls, env: Mapping[str, str], per_node: int) -> Layout:
        """The launcher's own place (``dist_env``: it is srun's task NODE of NODES), and its CPUs."""
        found = dist_env.detect(env)
        cpus = env.get("SLURM_CPUS_PER_TASK")
        return cls(node=found.rank, nodes=found.world_size, per_node=per_node, hostname=found.hostname,
                   job_id=found.job_id, cpus_per_task=int(cpus) if cpus and cpus.isdigit() else None)

    @property
    def ranks(self) -> range:
        return range(self.node * self.per_node, (self.node + 1) * self.per_node)

    def rank_env(self, local: int) -> dict[str, str]:
        """What srun gives the task of global rank ``ranks[local]`` when it starts every rank."""
        world = self.nodes * self.per_node
        tasks = f"{self.per_node}(x{self.nodes})" if self.nodes > 1 else str(self.per_node)
        env = {"SLURM_PROCID": str(self.ranks[local]), "SLURM_LOCALID": str(local),
               "SLURM_NTASKS": str(world), "SLURM_NPROCS": str(world), "SLURM_STEP_NUM_TASKS": str(world),
               "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_TASKS_PER_NODE": tasks,
               "SLURM_GTIDS": ",".join(str(r) for r in self.ranks)}
        if self.cpus_per_task is not None:
            env["SLURM_CPUS_PER_TASK"] = str(max(1, self.cpus_per_task // self.per_node))
        return env


def reason(code: int) -> str:
    """srun's words for how a task ended: ``Killed``, ``Segmentation fault``, ``Exited with exit code 1``."""
    if code < 0:
        return signal.strsignal(-code) or f"Signal {-code}"
    return f"Exited with exit code {code}"


class Report:
    """The launcher's lines, on its own stderr and appended to the batch script's stderr, where srun
    writes its lines and where the submitting side reads them."""

    def __init__(self, batch_stderr: Path, hostname: str) -> None:
        self.batch_stderr = batch_stderr
        self.hostname = hostname

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        try:
            fd = os.open(self.batch_stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            print(f"{SAYS}: cannot write to {self.batch_stderr}: {e}", file=sys.stderr, flush=True)

    def started(self, layout: Layout, unsafe: str | None) -> None:
        how = f"started as new processes: {unsafe}" if unsafe else "forked after one import"
        self.say(f"{SAYS}: node {self.hostname} (task {layout.node}) runs ranks "
                 f"{layout.ranks[0]}-{layout.ranks[-1]}, {how}")

    def ended(self, rank: int, code: int) -> None:
        self.say(f"{SAYS}: error: {self.hostname}: task {rank}: {reason(code)}")

    def stopping(self, rank: int) -> None:
        self.say(f"{SAYS}: stopping the other ranks of node {self.hostname} after rank {rank} ended")


# What the launcher exits with when its ranks stopped cleanly on a stop request: 128 + SIGTERM,
# as a shell reports a program SIGTERM ended (sacct: "15:0"), and as jobs.train and switchyard run
# exit when their job was stopped (launch.submit.STOPPED_EXIT_CODE).
STOPPED_STATUS = 128 + signal.SIGTERM


def supervise(ranks: Mapping[int, int], report: Report, grace_s: float = STOP_GRACE_S,
              stopped: Callable[[int], bool] = lambda rank: False) -> int:
    """Wait for the ranks (pid -> rank). Each that ends badly is reported; the first one's failure
    stops the others. Returns the exit status for srun: 0, the rank's code, or 128 + its signal.

    A rank that left on a stop request (``stopped``: its stop file, written after the checkpoint)
    exits non-zero too, and is reported as srun reported it, but stops nobody: the others stopped
    at the same step and are leaving (rank 0 perhaps still asking ``scontrol requeue``). When
    every rank that ended so left, the status is ``STOPPED_STATUS``: the ranks' own 255 read as
    "FAILED 127:0" in sacct (SLURM folds a status above 128 into a signal's), a failure nobody
    could explain, where a clean stop on SIGTERM (``scancel --signal=TERM``) is what happened."""
    living = dict(ranks)
    first: int | None = None
    all_stopped = True  # every rank that ended non-zero left on a stop request
    kill_at = float("inf")
    while living:
        try:  # blocking while nothing is due: the launcher costs nothing while its ranks train
            pid, status = os.waitpid(-1, os.WNOHANG if kill_at < float("inf") else 0)
        except ChildProcessError:
            break
        if pid == 0:
            if time.monotonic() > kill_at:
                signal_all(living, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(POLL_S)
            continue
        rank = living.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is None or code == 0:
            continue
        report.ended(rank, code)
        clean = stopped(rank)
        all_stopped = all_stopped and clean
        if first is None:
            first = code
            if clean:
                continue
            report.stopping(rank)
            signal_all(living, signal.SIGTERM)
            kill_at = time.monotonic() + grace_s
    if first is None:
        return 0
    if all_stopped:
        return STOPPED_STATUS
    return first if first > 0 else 128 - first


def signal_all(pids: Mapping[int, int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def die_with_parent(parent: int) -> None:
    """In a forked rank: SIGKILL from the kernel when the launcher dies (or has died already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def start_ranks(folder: Path, layout: Layout, job: str, unsafe: str | None) -> dict[int, int]:
    """Fork (or, where unsafe, start) the node's ranks: pid -> global rank."""
    from submitit.core import utils  # after the imports (why_not_fork): submitit imports numpy

    from orchestrator.launch import fork_start, job_entry
    started: dict[int, int] = {}
    for local, rank in enumerate(layout.ranks):
        paths = utils.JobPaths(folder, job, rank)
        env = layout.rank_env(local)
        with open(paths.stdout, "a") as out, open(paths.stderr, "a") as err:
            if unsafe:
                command = [sys.executable, "-u", "-m", job_entry.MODULE, str(folder)]
                proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=err)
                started[proc.pid] = rank
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:
                die_with_parent(parent)
                fork_start.become_rank(folder, {**env, "SLURM_TASK_PID": str(os.getpid())},
                                       out.fileno(), err.fileno(), f"the node launcher (pid {parent})")
            started[pid] = rank
    return started


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        raise SystemExit(f"usage: python -m {MODULE} SUBMITIT_FOLDER RANKS_PER_NODE MODULE[,MODULE...]")
    folder, per_node, preload = Path(args[0]), int(args[1]), [m for m in args[2].split(",") if m]
    hold_thread_pools()
    for signum in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):  # the ranks get SLURM's own
        signal.signal(signum, lambda signum, frame: None)
    os.environ[PRELOAD_ENV] = ",".join(preload)  # the ranks' first line names them
    layout = Layout.from_env(os.environ, per_node)
    job = layout.job_id
    unsafe = why_not_fork(preload)
    from submitit.core import utils

    from orchestrator.launch.submit import stopped_file
    report = Report(utils.JobPaths(folder, job, 0).stderr, layout.hostname)
    report.started(layout, unsafe)

    def stopped(rank: int) -> bool:
        return stopped_file(utils.JobPaths(folder, job, rank).result_pickle).exists()

    code = supervise(start_ranks(folder, layout, job, unsafe), report, stopped=stopped)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not the interpreter's teardown of what the ranks' imports left


if __name__ == "__main__":
    main()
