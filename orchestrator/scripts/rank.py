"""What each rank's Switchyard process does around the user's command.

submitit starts one Switchyard process per rank (one srun task, one local process, or this process
in debug mode). It checks the GPUs (preflight), serves or finds the job's store (``rank_env``),
starts the command with torchrun's variables, samples memory (local rank 0 of each node), and
turns the way the command ended into the job's outcome:

- exit 0: this rank is done;
- ``REQUEUE_EXIT_CODE`` (75, EX_TEMPFAIL: "try again"), or any end after SLURM's time-limit
  signal (SIGUSR2): rank 0 requeues the job (``scontrol requeue``) up to ``cluster.max_requeues``;
  a command still running ``signal_delay_s / 2`` after the signal is requeued anyway, so a script
  that ignores it still comes back before the time limit;
- after SIGTERM (preemption, ``scancel``, ``switchyard cancel``), whatever the exit status (a
  script that saves and exits 0 on SIGTERM has not finished its work): nothing more, SLURM decides;
- anything else: :class:`CommandFailed`, naming the rank, its node, the exit status or signal (the
  OOM killer too, when the rank's memory cgroup counted a kill) and the last lines of its output.
  srun's ``--kill-on-bad-exit`` (or Switchyard locally) then stops the other ranks, and the
  submitting side reports this rank as the cause.

The job's end is decided from every rank's end, never from rank 0's alone: rank 0 waits for every
rank's done file, and a rank that failed after rank 0's command had exited 0 fails the job
(``summary.json``, the status file and rank 0's own result say so).

Signals: SLURM delivers them to every process of the step, the command included; submitit's local
controller only to this process, which then passes SIGTERM and SIGUSR2 on.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from durable import atomic
from orchestrator.launch import dist_env, local_jobs, rank_env, run_lock, submit
from orchestrator.registry.status_file import TaskStatus
from orchestrator.telemetry.files import clear_end_summary, register_rank, write_end_summary
from orchestrator.telemetry.preflight import preflight
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.summary import summarize

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL; the same number as switchyard.preemption.REQUEUE_EXIT_CODE
TAIL_LINES = 8  # of each of stdout and stderr, in a failure's message
WAITING_NOTE_S = 60.0  # rank 0 says which ranks it still waits for after this long
KEPT_ENVIRONMENT = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CUDA_VISIBLE_DEVICES",
                    "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT", "HOSTNAME")


# The command of one rank ended badly; the message names the rank, node, status and output, and
# the job's failure report quotes it whole (submit.RankFailed).
CommandFailed = submit.RankFailed


@dataclass(frozen=True)
class CommandSpec:
    """Everything a rank needs, pickled once at submission (nothing is composed on the node)."""

    argv: list[str]
    cwd: str
    gpus_per_node: int
    max_requeues: int
    signal_delay_s: int
    rendezvous_timeout_s: float
    telemetry: bool = True
    telemetry_interval_s: float = 5.0


@dataclass(frozen=True)
class RankResult:
    """One rank's outcome, what the submitting side gets back per rank."""

    rank: int
    node: str
    exit_code: int
    wall_s: float
    # A SIGKILL's cause, as the kernel counts OOM kills in this rank's memory cgroup (``oom_kills``):
    # True, the OOM killer; False, not it; None, not killed by SIGKILL or the kernel does not say.
    oom_killed: bool | None = None


@dataclass(frozen=True)
class RankEnd:
    """How one rank's command (or function) ended, as its done file says."""

    rank: int
    node: str | None
    exit_code: int | None  # negative: killed by that signal; None: it left no done file (killed)
    ended_at: float
    stopped: bool = False  # it ended after a stop request (SIGTERM, SIGUSR2): not a failure of its own

    @property
    def failed(self) -> bool:
        return self.exit_code != 0 and not self.stopped


class StopRequest:
    """SIGUSR2 (time limit) and SIGTERM (preemption) as they reach this process: recorded until the
    command has ended (``command_ended``: a signal after it, while rank 0 waits for the others,
    does not make a finished command a stopped one), and passed on to the command where nothing
    else delivers them (``forward``)."""

    def __init__(self, forward: bool) -> None:
        self.forward = forward
        self.signum: int | None = None
        self.at = 0.0
        self.child: subprocess.Popen[bytes] | None = None
        self.ended = False

    def command_ended(self) -> None:
        self.ended = True

    def install(self) -> StopRequest:
        for signum in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.ended and self.signum != signal.SIGTERM:  # preemption outranks the time limit
            self.signum, self.at = signum, time.monotonic()
        if self.forward and self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    @property
    def time_limit(self) -> bool:
        return self.signum == signal.SIGUSR2

    @property
    def preempted(self) -> bool:
        return self.signum == signal.SIGTERM


def run_rank(spec: CommandSpec, run_dir: str) -> RankResult:
    """The function every rank runs (through submitit, or in this process with cluster=debug)."""
    env, run = dist_env.detect(), Path(run_dir)
    stop = StopRequest(forward=env.source != "slurm").install()
    with contextlib.ExitStack() as held:
        if env.is_main:
            held.enter_context(run_lock.hold(run, f"job {env.job_id} (rank 0, pid {os.getpid()} on "
                                                  f"{env.hostname})"))
        return _run_rank(spec, run, env, stop)


def _run_rank(spec: CommandSpec, run: Path, env: dist_env.DistEnv, stop: StopRequest) -> RankResult:
    report = preflight(spec.gpus_per_node, env.local_rank, env.local_world_size)
    print(report.describe(), flush=True)
    rdzv = run / "rendezvous"
    store, endpoint = rank_env.serve_or_find_store(env, rdzv, spec.rendezvous_timeout_s)
    variables = rank_env.rank_variables(env, endpoint, run, spec.max_requeues)
    _record_environment(run, env, variables)
    status = report_start(run, env)
    started = time.monotonic()
    child = spawn(spec, variables)
    stop.child = child
    register_rank(run, env.rank, env.local_rank, env.hostname, report.device_index, pid=child.pid)
    sampler = MemorySampler(run, env.hostname, spec.telemetry_interval_s, attempt=env.restart_count) \
        if spec.telemetry and env.is_local_main else None
    code, ended_at, ooms = -signal.SIGKILL, time.time(), oom_kills()
    try:
        with sampler or contextlib.nullcontext():
            code = wait(child, stop, env, spec)
            stop.command_ended()
            ended_at = time.time()
    finally:
        _stop_child(child)
        mark_done(rdzv, env, code, ended_at,
                  stopped=stop.preempted or (stop.signum is not None and code != 0))
    oom = (oom_kills() or 0) > ooms if code == -signal.SIGKILL and ooms is not None else None
    result = RankResult(env.rank, env.hostname, code, time.monotonic() - started, oom)
    return conclude(result, spec, run, env, stop, status, store)


def spawn(spec: CommandSpec, variables: dict[str, str]) -> subprocess.Popen[bytes]:
    """The user's command with this rank's variables; its output is this rank's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return subprocess.Popen(spec.argv, cwd=spec.cwd, env={**os.environ, **variables},
                                preexec_fn=_die_with_parent)
    except OSError as e:
        raise CommandFailed(f"cannot start {spec.argv[0]!r} in {spec.cwd}: {e}") from e


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


# Looked up here, not in the child: between fork and exec only the call itself runs (rank 0's
# store thread may hold the loader's or malloc's lock at the fork).
_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when this Switchyard process dies (a SIGKILL from srun,
    the OOM killer), so no rank's command outlives the process that reports on it."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait(child: subprocess.Popen[bytes], stop: StopRequest, env: dist_env.DistEnv,
         spec: CommandSpec) -> int:
    """The command's exit status (negative: killed by that signal). Rank 0 stops waiting for a
    command that ignores the time-limit signal half the warning time after it: -SIGUSR2."""
    grace_s = max(spec.signal_delay_s / 2, 1.0)
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=0.2)
        if env.is_main and stop.time_limit and time.monotonic() - stop.at > grace_s:
            print(f"switchyard: the command still runs {grace_s:.0f} s after the time-limit signal; "
                  f"requeueing without its checkpoint", flush=True)
            return -signal.SIGUSR2


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()


def conclude(result: RankResult, spec: CommandSpec, run: Path, env: dist_env.DistEnv,
             stop: StopRequest, status: TaskStatus | None, store: Any) -> RankResult:
    """This rank's outcome from how its command ended (the module docstring has the rules)."""
    code = result.exit_code
    if code == REQUEUE_EXIT_CODE or (stop.time_limit and code != 0):
        _requeue_or_fail(result, spec, env, run)
    if stop.preempted:  # exit 0 too: a command that saves and exits 0 on SIGTERM was stopped, not done
        how = "" if code != 0 else " (its command exited 0 after it)"
        print(f"switchyard: rank {env.rank} stopped by SIGTERM (preemption or cancel){how}", flush=True)
        raise rank_env.AttemptNotOver(-1)  # no result: the attempt is not over, SLURM decides what comes next
    if code != 0:
        error = describe_failure(result, spec, first_failure(run / "rendezvous", env))
        if env.is_main:
            _write_summary(run, env, spec, result, exit_status(code), error.splitlines()[0], {})
        report_end(run, status, exit_status(code), error.splitlines()[0], telemetry=spec.telemetry)
        raise failed(error, exit_status(code))
    if env.is_main:
        conclude_job(result, spec, run, env, status)
    del store  # rank 0: the store lives until here, when every rank's command has ended
    return result


def conclude_job(result: RankResult, spec: CommandSpec, run: Path, env: dist_env.DistEnv,
                 status: TaskStatus | None) -> None:
    """Rank 0, its command exited 0: the job's end, from every rank's. A rank that failed after
    this one ended fails the job (and this rank, so a sweep point's report says so too)."""
    ends = wait_for_ranks(run / "rendezvous", env)
    peer = first_failed(ends)
    if peer is None and any(end.stopped for end in ends.values()):
        print(f"switchyard: rank {env.rank}'s command ended, but ranks "
              f"{[r for r, e in ends.items() if e.stopped]} were stopped (preemption or cancel)", flush=True)
        raise rank_env.AttemptNotOver(-1)  # as for a stopped rank: SLURM decides
    code = 0 if peer is None else exit_status(peer.exit_code)
    error = None if peer is None else (f"the job failed after rank {peer.rank} had failed: "
                                       f"{describe_end(peer, spec)} (rank {env.rank}'s command had "
                                       f"exited 0)")
    _write_summary(run, env, spec, result, code, error, ends)
    report_end(run, status, code, error, telemetry=spec.telemetry and error is not None)
    if error is not None:
        raise failed(error, code)


def failed(message: str, exit_code: int) -> CommandFailed:
    """A CommandFailed that carries the exit status a job's status shows (a sweep point's too)."""
    error = CommandFailed(message)
    error.exit_code = exit_code  # type: ignore[attr-defined]  # kept when pickled (in __dict__)
    return error


def exit_status(code: int | None) -> int:
    """A command's end as a shell's ``$?`` shows it: its status, 128 + N when killed by signal N,
    1 when unknown (a rank that left no done file)."""
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


def how_it_ended(code: int | None, oom_killed: bool | None = None) -> str:
    """``exited with status 3``, ``was killed by SIGKILL (the OOM killer: ...)``; the OOM killer
    is named only as the kernel says (``RankResult.oom_killed``)."""
    if code is None:
        return "ended without a report (its Switchyard process was killed)"
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    if oom_killed is True:
        return f"was killed by {name} (the OOM killer: its memory cgroup counted an oom_kill)"
    if oom_killed is False:
        return f"was killed by {name} (not the OOM killer: its memory cgroup counted no oom_kill)"
    return f"was killed by {name}" + (" (kill -9, or the OOM killer)" if -code == signal.SIGKILL else "")


def describe_end(end: RankEnd, spec: CommandSpec) -> str:
    node = f" on node {end.node}" if end.node else ""
    return f"rank {end.rank}{node}: `{' '.join(spec.argv)}` {how_it_ended(end.exit_code)}"


def first_failed(ends: dict[int, RankEnd]) -> RankEnd | None:
    """The rank other than 0 whose command failed (the first to fail, by its done file's time)."""
    failures = [end for end in ends.values() if end.failed]
    return min(failures, key=lambda e: (e.ended_at, e.rank)) if failures else None


def _requeue_or_fail(result: RankResult, spec: CommandSpec, env: dist_env.DistEnv, run: Path) -> None:
    """Rank 0 requeues (SLURM then stops every rank); the others leave without a result."""
    asked = "asked to be requeued" if result.exit_code == REQUEUE_EXIT_CODE else "stopped at the time limit"
    if env.source != "slurm":
        raise CommandFailed(f"rank {env.rank}: the command {asked} (exit {result.exit_code}), but only "
                            f"SLURM requeues (cluster=slurm); rerun with hydra.run.dir={run} to continue")
    if not env.is_main:
        raise rank_env.AttemptNotOver(0)  # not a failure: srun must not stop rank 0 before it requeues
    if env.restart_count >= spec.max_requeues:
        raise CommandFailed(f"job {env.job_id}: the command {asked} again after {env.restart_count} "
                            f"requeues (cluster.max_requeues={spec.max_requeues}); raise "
                            f"cluster.max_requeues or cluster.timeout_min")
    # Said first: SLURM stops every rank as soon as the requeue is taken, and on a loaded node
    # that came before a line printed after ``scontrol`` returned.
    print(f"switchyard: requeueing job {env.job_id}: the command {asked} "
          f"({env.restart_count + 1}/{spec.max_requeues} requeues)", flush=True)
    requeue(env.job_id)
    raise rank_env.AttemptNotOver(0)


def requeue(job_id: str) -> None:
    """Back into the queue; SLURM stops every rank and starts the job again, restart count + 1."""
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60,
                          check=False)
    if proc.returncode != 0:
        raise CommandFailed(f"scontrol requeue {job_id} failed: {proc.stderr.strip()}")


def describe_failure(result: RankResult, spec: CommandSpec, first: int | None = None) -> str:
    """``rank 2 on node n2: `python x.py` exited with status 3`` and the last lines it printed;
    ``first``: another rank whose command had failed before this one's (this is a consequence)."""
    how = how_it_ended(result.exit_code, result.oom_killed)
    after = f" after rank {first} had failed" if first is not None and first != result.rank else ""
    lines = [f"rank {result.rank} on node {result.node}: `{' '.join(spec.argv)}` {how}{after}"]
    for name, text in own_log_tails().items():
        lines.append(f"its {name} ends:\n    " + "\n    ".join(text) if text else f"its {name} is empty")
    return "\n".join(lines)


def first_failure(rdzv: Path, env: dist_env.DistEnv, settle_s: float = 1.0) -> int | None:
    """The rank whose command failed first, from every rank's done file: a rank that loses a
    peer fails too, a moment later, with an error of its own ("connection closed"), and must not
    be reported as the cause. Waits ``settle_s`` for the others' files first."""
    time.sleep(settle_s)
    ends = [end for end in read_ends(rdzv, env, range(env.world_size)).values()
            if end.exit_code not in (0, None)]
    return min(ends, key=lambda e: (e.ended_at, e.rank)).rank if ends else None


def own_log_tails() -> dict[str, list[str]]:
    """The last lines of this rank's submitit logs (where the command's output went); none in
    debug mode, where the output is on the terminal."""
    try:
        import submitit

        paths = submitit.JobEnvironment().paths
    except Exception:  # not a submitit job: debug mode
        return {}
    return {name: _tail(path) for name, path in (("stderr", paths.stderr), ("stdout", paths.stdout))}


def _tail(path: Path) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    kept = [line for line in text.splitlines() if line.strip() and "submitit " not in line]
    return kept[-TAIL_LINES:]


def mark_done(rdzv: Path, env: dist_env.DistEnv, code: int, ended_at: float, stopped: bool = False
              ) -> None:
    """This rank's command (or function) has ended, how, when and where: rank 0 waits for every
    rank's before it lets the store go and decides the job's end from them, and a failing rank
    learns whether another failed first. ``stopped``: it ended after a stop request."""
    atomic.write_json(rank_env.done_file(rdzv, env, env.rank),
                      {"exit_code": code, "ended_at": ended_at, "node": env.hostname, "stopped": stopped},
                      durable=False)


def read_ends(rdzv: Path, env: dist_env.DistEnv, ranks: Iterable[int]) -> dict[int, RankEnd]:
    """The done files of these ranks that are there (a file being replaced reads as absent)."""
    ends = {}
    for rank in ranks:
        try:
            done = json.loads(rank_env.done_file(rdzv, env, rank).read_text())
            code = done.get("exit_code")
            ends[rank] = RankEnd(rank, done.get("node"), code if isinstance(code, int) else None,
                                 float(done["ended_at"]), bool(done.get("stopped", False)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ends


def wait_for_ranks(rdzv: Path, env: dist_env.DistEnv, poll_s: float = 0.1) -> dict[int, RankEnd]:
    """Every rank's end (rank 0 keeps the store until then, and decides the job's end from them).

    The wait has an end without a deadline: on SLURM, a rank killed before it wrote its done file
    makes srun stop the step, rank 0 included. Locally nothing does, so a rank whose process is
    gone without one is counted as killed (``exit_code`` None) instead of waited for.
    """
    ends: dict[int, RankEnd] = {}
    started, checked, told = time.monotonic(), time.monotonic(), False
    while missing := [r for r in range(env.world_size) if r not in ends]:
        ends.update(read_ends(rdzv, env, missing))
        if env.source == "local" and time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            alive = set(local_jobs.ranks(os.getppid()))
            gone = [r for r in missing if r not in alive and r not in ends]
            ends.update(read_ends(rdzv, env, gone))  # it may have written its file, then exited
            ends.update({r: RankEnd(r, None, None, time.time()) for r in gone if r not in ends})
        if not told and time.monotonic() - started > WAITING_NOTE_S:
            told = True
            print(f"switchyard: rank {env.rank}'s command has ended; waiting for ranks "
                  f"{[r for r in range(env.world_size) if r not in ends]} to end", flush=True)
        time.sleep(poll_s)
    return ends


MEMORY_CGROUP_ROOT = Path("/sys/fs/cgroup")


def oom_kills(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = MEMORY_CGROUP_ROOT) -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup
    (``oom_kill`` in cgroup v2's ``memory.events``, or v1's ``memory.oom_control``); None where
    the kernel does not say (no cgroup, an old kernel, unreadable). SLURM puts each step's tasks
    in their own cgroup with its memory limit, so a count that grew while the command ran means
    the OOM killer, not a ``kill -9``, ended it."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controllers == "":  # v2: one hierarchy
            candidates.append(root / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / path.lstrip("/") / "memory.oom_control")
    for file in candidates:
        try:
            for entry in file.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def _record_environment(run: Path, env: dist_env.DistEnv, variables: dict[str, str]) -> None:
    """RUN/env/rank-R.json: what Switchyard set for this rank, and the parts of its environment
    that decide what ran (PATH, the virtual environment, the GPUs it saw)."""
    record = {"node": env.hostname, "set": variables,
              "inherited": rank_env.environment_record(os.environ, KEPT_ENVIRONMENT)}
    atomic.write_json(run / "env" / f"rank-{env.rank}.json", record, indent=1, durable=False)


def report_start(run: Path, env: dist_env.DistEnv) -> TaskStatus | None:
    """Rank 0's status file for ``switchyard status`` (a sweep point's, or a single job's)."""
    if not env.is_main:
        return None
    clear_end_summary(run)
    status = TaskStatus(job_id=env.job_id, started_at=time.time(), restarts=env.restart_count,
                        node=env.hostname)
    status.write(run)
    return status


def report_end(run: Path, status: TaskStatus | None, code: int, error: str | None,
                telemetry: bool) -> None:
    if status is None:
        return
    if telemetry:
        with contextlib.suppress(Exception):  # the command's own failure is what the job reports
            write_end_summary(run, summarize(run))
    TaskStatus(**{**status.__dict__, "ended_at": time.time(), "exit_code": code,
                  "error": error}).write(run)


def _write_summary(run: Path, env: dist_env.DistEnv, spec: CommandSpec, result: RankResult,
                   exit_code: int, error: str | None, ends: dict[int, RankEnd]) -> None:
    """RUN/summary.json: the job's end (``exit_code``: the failing rank's status as ``$?`` shows
    it, whichever rank failed; ``error``: which rank, and how), every rank's end that rank 0
    saw (none when rank 0 failed first), and the memory section."""
    ranks = [{"rank": e.rank, "node": e.node, "exit_code": e.exit_code, "stopped": e.stopped}
             for e in sorted(ends.values(), key=lambda e: e.rank)]
    summary = {"world_size": env.world_size, "command": spec.argv, "exit_code": exit_code,
               "error": error, "ranks": ranks, "wall_s": round(result.wall_s, 3), "node": env.hostname,
               "memory": summarize(run) if spec.telemetry else None}
    atomic.write_json(run / "summary.json", summary, indent=2)


@contextlib.contextmanager
def redirected_signals() -> Iterator[None]:
    """Debug mode runs ranks in this process: its own handlers come back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)

