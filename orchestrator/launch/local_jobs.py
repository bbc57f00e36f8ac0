"""Stopping a local job's processes: what SLURM does for a cluster job, done by hand.

A local job (``cluster=local``) is a submitit controller process whose children are the ranks;
the job's id is the controller's pid. Two facts make submitit's own stop unreliable:

- ``LocalJob.cancel()`` sends SIGINT to the controller, and a process started with SIGINT
  ignored never acts on it: a shell's background jobs (``cmd &``, nohup, many CI runners)
  ignore SIGINT, and every child inherits that.
- SIGTERM to the controller is forwarded to the ranks, but submitit's rank entry point bypasses
  SIGTERM (it keeps it for SLURM preemption), so a plain function never stops. Switchyard's
  trainer does act on it: it checkpoints at the next step boundary and exits (the same as on
  ``scancel``).

A third: submitit starts the controller with this process's stdout and stderr, so a
non-blocking local sweep run under a pipe (``| tee``, ``$(...)``, a CI step) did not end
until its jobs did: the pipe stayed open in the controllers. ``detached_output`` points the
controllers' output at a log file instead.

So ``terminate`` mirrors ``scancel``: SIGTERM, a grace period (SLURM's KillWait), then SIGKILL
to every rank still alive; ``kill`` skips the grace. Killing the ranks ends the controller too:
it sees every task exit and returns. Only psutil here: ``switchyard cancel`` stays light.

A controller killed outright (``kill -9``, the OOM killer) is what srun's death is on SLURM: each
rank asked the kernel to kill it then (``die_with_controller``), and a listed rank still running
(one forked before it asked, and what it started) is found by ``leftover_ranks`` for ``switchyard
cancel``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

KILL_WAIT_S = 30.0  # SLURM's default KillWait: SIGTERM to SIGKILL
# In the command line of submitit's local controller, and of Switchyard's, which forks the ranks
# (orchestrator/launch/fork_start.py): a forked rank's command line is its controller's.
CONTROLLERS = ("submitit.local._local", "orchestrator.launch.fork_start")
# The name of a controller forked from its submitter (fork_start.ControllerTemplate), whose command
# line is the submitter's.
FORKED_CONTROLLER = "sy-controller"


def is_controller(process: psutil.Process) -> bool:
    if process.name() == FORKED_CONTROLLER:
        return True
    command = " ".join(process.cmdline())
    return any(name in command for name in CONTROLLERS)


def controller(pid: int) -> psutil.Process | None:
    """The live local-job controller with this pid, or None: it has exited, and the pid may
    since belong to an unrelated process, which is never signalled."""
    try:
        process = psutil.Process(pid)
        if is_controller(process):
            return process
    except psutil.Error:
        pass
    return None


def forked_ranks_file(folder: Path, controller_pid: int) -> Path:
    """Where a forking controller lists its ranks' pids by local id (written at each start): a
    forked rank's command line and environment are its controller's, so nothing else tells them.
    ``folder``: the job's submitit folder, its ``%j`` filled in."""
    return folder / f"{controller_pid}_forked_ranks.json"


def _forked(process: psutil.Process, folder: Path | None) -> dict[int, int]:
    """pid -> local id of the ranks ``process`` forked; {} for submitit's controller. ``folder``:
    the job's submitit folder, else the last word of the controller's command line (a forked
    controller's is its submitter's: the caller names the folder)."""
    with contextlib.suppress(psutil.Error, OSError, ValueError, IndexError):
        where = folder if folder is not None else Path(process.cmdline()[-1].replace("%j", str(process.pid)))
        listed = json.loads(forked_ranks_file(where, process.pid).read_text())
        return {int(pid): int(local) for pid, local in listed.items()}
    return {}


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    """The ranks and everything they started (DataLoader workers); none once it has exited."""
    with contextlib.suppress(psutil.Error):
        return list(process.children(recursive=True))
    return []


def ranks(pid: int, folder: Path | None = None) -> dict[int, psutil.Process]:
    """The live rank processes of the local job ``pid``, by rank (their local id): the
    processes a controller started, not what they started in turn (DataLoader workers).
    ``folder``: the job's submitit folder (needed for a controller forked from its submitter)."""
    process = controller(pid)
    found: dict[int, psutil.Process] = {}
    if process is None:
        return found
    forked: dict[int, dict[int, int]] = {}  # a controller's pid -> the ranks it forked
    with contextlib.suppress(psutil.Error):
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error, KeyError, ValueError):
                parent = child.parent()
                if parent is None or not is_controller(parent):
                    continue  # started by a rank, not by the controller
                if parent.pid not in forked:  # the controller itself, or one under a setup shell
                    forked[parent.pid] = _forked(parent, folder)
                if child.pid in forked[parent.pid]:
                    found[forked[parent.pid][child.pid]] = child
                    continue
                if is_controller(child):
                    continue  # the controller itself under a setup shell, or a rank not yet listed
                found[int(child.environ()["SUBMITIT_LOCAL_LOCALID"])] = child
    return found


def leftover_ranks(pid: int, folder: Path | None) -> list[psutil.Process]:
    """The ranks of the local job ``pid`` still alive though its controller has gone, and what they
    started: ranks forked before ``die_with_controller`` existed, or whose controller died before
    they had asked for it. The pids its controller listed (``forked_ranks_file``), each only while
    it is still the process forked then (created by the time the list was written), never a
    process that took a freed pid since. [] while the controller lives (``terminate`` stops it)."""
    if folder is None or controller(pid) is not None:
        return []
    listed = forked_ranks_file(folder, pid)
    try:
        written = listed.stat().st_mtime
        pids = [int(p) for p in json.loads(listed.read_text())]
    except (OSError, ValueError, TypeError):
        return []
    found = []
    for rank_pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(rank_pid)
            if written - FORK_TO_LIST_S <= process.create_time() <= written + 1.0 and alive(process):
                found += [process, *_descendants(process)]
    return found


# The most a controller takes from forking its first rank to writing their list (ForkingController).
FORK_TO_LIST_S = 60.0


def stop_leftovers(processes: Sequence[psutil.Process], grace_s: float) -> int:
    """SIGTERM (a trainer checkpoints at its next step), then SIGKILL after ``grace_s`` to what is
    left; -> how many were running."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    _, living = psutil.wait_procs(processes, timeout=grace_s)
    for process in living:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(living, timeout=10)
    return len(processes)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_controller() -> None:
    """In a local job's rank: the kernel sends it SIGKILL when its controller dies (``kill -9``, the
    OOM killer), as a SLURM rank dies with its launcher, so no rank trains on as an orphan holding
    the run's lock. The controller is the rank's parent, forked or started (the rank's fork comes
    from the controller itself, never from the template or the submitter it was forked from); one
    already gone ends the rank now. Not Linux: nothing to ask."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if controller(os.getppid()) is None:  # it died before the request: no signal will come
        print(f"switchyard: this rank's controller has ended (its parent is now pid {os.getppid()}): "
              f"the job is over, so the rank exits", file=sys.stderr, flush=True)
        os._exit(1)


def alive(process: psutil.Process) -> bool:
    """Running, and not a zombie its parent has yet to reap."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill(pid: int) -> None:
    """SIGKILL every rank of the local job ``pid`` (and what they started) now."""
    process = controller(pid)
    if process is None:
        return
    for child in _descendants(process):
        with contextlib.suppress(psutil.Error):
            child.kill()


def terminate(pids: Sequence[int], grace_s: float = KILL_WAIT_S) -> list[int]:
    """Stop local jobs as ``scancel`` stops cluster jobs; -> the pids that were running.

    SIGTERM goes to each controller, which forwards it to its ranks; ranks that act on it
    (the trainer) checkpoint and exit. After ``grace_s`` seconds, or as soon as every job
    has ended, ranks still alive are killed. Returns once every job's processes are gone.
    """
    live = {pid: process for pid in pids if (process := controller(pid)) is not None}
    for process in live.values():
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in live.values()):
        time.sleep(0.1)
    for pid in live:
        kill(pid)
    leftover = [p for process in live.values() for p in [*_descendants(process), process]]
    psutil.wait_procs(leftover, timeout=10)
    return list(live)


@contextlib.contextmanager
def detached_output(log: Path) -> Iterator[None]:
    """Inside, this process's fds 1 and 2 append to ``log``, so controllers started here
    inherit the file, not a pipe a caller waits on. Restored on the way out; Python's own
    buffered output is flushed first, so none of it lands in the log by mistake."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)
