"""Config -> submitit executor (debug | local | slurm), and job results with failures explained.

This is where typed config meets submitit: nothing past this module sees a DictConfig, and nothing
before it sees submitit.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError, pickle_load
from submitit.local.local import LocalJob

from orchestrator.config import SBATCH_OPTIONS, ClusterConfig, ConfigError, ParallelismConfig, sbatch_option
from orchestrator.launch import (
    bad_nodes,
    container,
    dist_env,
    hang_dumps,
    heartbeat,
    local_jobs,
    slurm_query,
    slurm_request,
    snapshot,
)
from orchestrator.registry.states import stopped_state

R = TypeVar("R")

# srun ends the whole step when one task exits non-zero: the other ranks are killed instead of
# waiting in a collective for the 30-minute default timeout.
FAIL_FAST_SRUN_ARGS = ("--kill-on-bad-exit=1",)


class JobFailedError(RuntimeError):
    """A job ended without results; the message names the failing rank(s), node and log tail."""

    def __init__(self, message: str, job_id: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.failed_ranks = failed_ranks


class JobStoppedError(JobFailedError):
    """Every rank that did not finish stopped on a stop request (``switchyard cancel``, scancel,
    preemption) and left cleanly, its checkpoint written: not a failure. The message says where
    it stopped (``stopped by PREEMPTED at step 676; checkpoint in RUN/checkpoints``)."""

    def __init__(self, message: str, job_id: str, state: str) -> None:
        super().__init__(message, job_id, [])
        self.state = state  # CANCELLED locally (only a cancel stops a local job), else SLURM's


# ``jobs.train`` and ``switchyard run`` exit with this when their job was stopped: 128 + SIGTERM,
# as a shell reports a program that SIGTERM ended (errors exit 2).
STOPPED_EXIT_CODE = 143


class RankFailed(RuntimeError):
    """A rank's own failure whose message says everything (which rank, how it ended, its output's
    last lines): the job's report quotes that message, not the traceback through Switchyard."""


# How submitit's error text names it: the report cuts the message out of the traceback there.
_RANK_FAILED = f"{RankFailed.__module__}.{RankFailed.__qualname__}: "
_SUBMITIT_FOOTER = "\n----------------------"


def quoted(error: str) -> str:
    """What a failure report quotes of a rank's error: a RankFailed's message alone, else all."""
    start = error.rfind(_RANK_FAILED)
    if start < 0:
        return error
    return error[start + len(_RANK_FAILED):].split(_SUBMITIT_FOOTER, 1)[0]


class SubmissionError(ConfigError):
    """sbatch refused the job, or it can never start; nothing of it is left queued."""


def make_executor(cluster: ClusterConfig, parallelism: ParallelismConfig,
                  folder: Path, code: snapshot.Snapshot | None = None,
                  paths: Sequence[container.Need] = (),
                  rank_modules: Sequence[str] = (), own_code: bool = False) -> submitit.Executor:
    """The executor for ``cluster.mode``; one task per GPU, or per process on CPU. On SLURM, with
    ``code``, every rank imports from that snapshot (``snapshot.setup_lines``). ``paths``: what the
    ranks read or write, mounted into ``cluster.container``'s image.
    ``rank_modules``: what every rank imports before its first step; one process per node imports
    them once and forks the ranks (``fork_start``: a local job's controller, SLURM's node launcher)
    where ``cluster.forks_ranks``. ``own_code``: the job's process runs Switchyard's code, not a
    user's Python function, and ends without the interpreter's teardown (``job_entry``)."""
    if cluster.mode == "debug":
        from orchestrator.launch import fork_start
        fork_start.release_template()  # it trains here
        return submitit.DebugExecutor(folder=folder)
    forked = rank_modules if cluster.forks_ranks else ()
    if cluster.mode == "local":
        return new_executor("local", local_parameters(cluster, parallelism), folder, rank_modules=forked,
                            own_code=own_code)
    check_log_folder(folder)
    params = slurm_parameters(cluster, parallelism)
    if code is not None:
        params["setup"] = [*snapshot.setup_lines(code), *cluster.setup]
    params.update(container_parameters(cluster, parallelism, folder.parent, code, paths, params["setup"]))
    return new_executor("slurm", params, folder, cluster.max_requeues, rank_modules=forked, own_code=own_code,
                        restarts=cluster.restarts)


def container_parameters(cluster: ClusterConfig, parallelism: ParallelismConfig, run_dir: Path,
                         code: snapshot.Snapshot | None, paths: Sequence[container.Need],
                         setup: Sequence[str] = (), run_key: str = "hydra.run.dir") -> dict[str, Any]:
    """What ``cluster.container`` changes in the submitit parameters: the ``setup`` lines then the
    image's for the ranks, pyxis's srun arguments, the ``python`` that runs each rank
    (``new_executor`` hands it to submitit), after the checks that refuse what would fail on every
    node (``container.check``, ``container.mounts_for``). ``run_key``: the key that names
    ``run_dir`` (a sweep's: hydra.sweep.dir)."""
    box = cluster.container
    if box.runtime == "none":
        return {}
    warnings = container.check(box, dry_run=cluster.dry_run)  # printed once nothing is refused
    needs = [container.Need(run_key, run_dir),
             container.Need("cluster.snapshot.dir", code.path if code else None,
                            named=str(code.path.parent) if code else None),
             container.Need("the submitting directory (on PYTHONPATH)", os.getcwd(), shared=True,
                            fix="submitting from a directory without ',' or ':' in its path"), *paths]
    mounts = container.mounts_for(box, needs, dry_run=cluster.dry_run)
    container.warn(warnings)
    return {"setup": [*setup, *container.setup_lines(box)],
            "srun_args": [*FAIL_FAST_SRUN_ARGS, *cluster.srun_args,
                          *container.srun_args(box, mounts, run_dir)],
            "python": container.python(box, mounts, parallelism.gpus_per_node)}


def new_executor(mode: str, params: Mapping[str, Any], folder: Path, max_requeues: int = 0,
                 array_parallelism: int | None = None, rank_modules: Sequence[str] = (),
                 own_code: bool = False, restarts: int = 0) -> submitit.Executor:
    """A local or SLURM executor from its submitit parameters: the one factory behind single jobs
    (:func:`make_executor`) and sweep arrays (``sweeps.arrays.make_executor``).
    ``array_parallelism`` (SLURM only): at most this many tasks of one array at once.
    ``rank_modules``: one process per node (the local controller, SLURM's node launcher) imports
    them once and forks the ranks (``fork_start``), for a single job or each task of an array.
    ``own_code``: each task's process runs only Switchyard's code and the user's model, not a
    user's Python function: it starts through ``job_entry`` (no teardown at its end)."""
    from orchestrator import library_versions
    from orchestrator.launch import fork_start, job_entry
    if not library_versions.hooks_allowed("submitit"):  # submitit's own executors and entry
        rank_modules, own_code = (), False
    if mode != "local" or not rank_modules:
        fork_start.release_template()  # no controller of this process's will be forked from it
    if mode == "local":
        if rank_modules:
            local: submitit.LocalExecutor = fork_start.ForkingLocalExecutor(folder, rank_modules)
        else:
            local = (job_entry.LocalExecutor if own_code else submitit.LocalExecutor)(folder=folder)
        local.update_parameters(**params)
        return local
    params = dict(params)  # "python": the command that runs the ranks' Python (a container's)
    if rank_modules:
        slurm: submitit.SlurmExecutor = fork_start.ForkingSlurmExecutor(folder, rank_modules, max_requeues,
                                                             python=params.pop("python", None))
    else:
        kind = job_entry.SlurmExecutor if own_code else submitit.SlurmExecutor
        slurm = kind(folder=folder, max_num_timeout=max_requeues, python=params.pop("python", None))
    if restarts:  # the batch script's loop around the step (launch/restarts.py)
        if not isinstance(slurm, job_entry.Restarting):
            raise ConfigError(f"cluster.restarts={restarts} is invalid here: a job that runs your own "
                              f"Python function ends with submitit's own entry, which cannot be "
                              f"restarted inside its allocation (try cluster.restarts=0, or run it as "
                              f"a command: switchyard run ... -- python your_script.py)")
        slurm.restarts = restarts
    limit = {} if array_parallelism is None else {"array_parallelism": array_parallelism}
    slurm.update_parameters(**params, **limit)
    return slurm


def sbatch_script(executor: submitit.Executor) -> str:
    """The sbatch script ``executor.submit`` would queue, byte for byte (submitit renders it the
    same way when it submits; only the job id in the log paths is filled in by sbatch)."""
    assert isinstance(executor, submitit.SlurmExecutor)
    return executor._make_submission_file_text(executor._submitit_command_str, uid="")


def dry_run_text(executor: submitit.Executor, folder: Path) -> str:
    """What ``cluster.dry_run=true`` prints: that nothing was queued, and the script that would be."""
    return (f"dry run (cluster.dry_run=true): nothing was queued. The job's directory would be "
            f"{folder}; the sbatch script:\n{sbatch_script(executor)}")


def check_log_folder(folder: Path) -> None:
    """The job's log paths go into ``#SBATCH --output``, where sbatch expands ``%j``, ``%x``, ...:
    a ``%`` in the run directory would send the logs where submitit never looks for them."""
    if "%" in str(folder):
        raise ConfigError(f"hydra.run.dir={str(folder.parent)!r} is invalid: it holds '%', which "
                          f"sbatch expands in log file names (%j: job id), so the job's logs and "
                          f"results would land elsewhere (try hydra.run.dir=<a path without %>)")


def local_parameters(cluster: ClusterConfig, parallelism: ParallelismConfig,
                     environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """submitit LocalExecutor parameters: every rank of every "node" runs on this machine.

    The GPUs are handed over explicitly: the LocalExecutor sets its tasks' ``CUDA_VISIBLE_DEVICES``
    from ``gpus_per_node`` and hides every GPU when it is not given. It also numbers the GPUs from 0,
    ignoring what this process was shown; so this process's own ``CUDA_VISIBLE_DEVICES`` (a GPU
    workstation shared by ``CUDA_VISIBLE_DEVICES=2,3``) is passed on: its indices as
    ``visible_gpus``, or, for UUIDs and MIG instances, re-exported before the ranks start.
    """
    params: dict[str, Any] = {"tasks_per_node": parallelism.world_size, "nodes": 1,
                              "timeout_min": cluster.timeout_min}
    gpus = parallelism.gpus_per_node
    if gpus == 0:
        return params
    params["gpus_per_node"] = gpus
    spec = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in spec.split(",") if e.strip()] if spec else []
    if entries and all(re.fullmatch(r"\d+", e) for e in entries):
        params["visible_gpus"] = tuple(int(e) for e in entries)
    elif entries:
        params["setup"] = [f"export CUDA_VISIBLE_DEVICES={shlex.quote(','.join(entries[:gpus]))}"]
    return params


def slurm_parameters(cluster: ClusterConfig, parallelism: ParallelismConfig) -> dict[str, Any]:
    """submitit SlurmExecutor parameters: each option of ``config.SBATCH_OPTIONS`` from its key, then
    ``cluster.sbatch_args`` (which may not repeat one of them), setup and srun arguments."""
    params: dict[str, Any] = {
        "setup": list(cluster.setup),
        "srun_args": [*FAIL_FAST_SRUN_ARGS, *cluster.srun_args],
        "stderr_to_stdout": False,
    }
    extra = dict(sbatch_option(f"cluster.sbatch_args[{i}]", arg)
                 for i, arg in enumerate(cluster.sbatch_args))
    for option in SBATCH_OPTIONS:
        value = option.value(cluster, parallelism) if option.param is not None else None
        if value is None:
            continue
        if option.extra:
            extra[option.option] = value
        else:
            params[str(option.param)] = value
    if extra:  # submitit writes each as #SBATCH --name[=value] (its keys use '_' for '-')
        params["additional_parameters"] = {name.replace("-", "_"): value for name, value in extra.items()}
    return params


RANK_BANNER = "switchyard: rank {rank}/{world} on node {node} (local rank {local}, job {job}, pid {pid})"


@dataclass(frozen=True)
class RankEntry:
    """What each task runs: say who it is in its log first, then call the job function.

    submitit logs the OS hostname; on SLURM the node *name* (``n1``) is what a user looks up in
    ``sinfo``/``sacct``, so failures are reported with the line printed here.
    """

    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        env = dist_env.detect()
        if env.source == "local":  # on SLURM, srun (or the node launcher) takes its ranks along
            local_jobs.die_with_controller()
        print(RANK_BANNER.format(rank=env.rank, world=env.world_size, node=env.hostname,
                                 local=env.local_rank, job=env.job_id, pid=os.getpid()), flush=True)
        snap = snapshot.current()
        wrong_image = container.rank_check(os.environ, snap is not None and snapshot.imported_from(__file__))
        if wrong_image is not None:
            raise RankFailed(wrong_image)
        if snap is not None:
            if not snap.files:  # deleted after the job's script checked it (snapshot.setup_lines)
                raise RankFailed(snapshot.gone_line(snap.path))
            print(code_banner(), flush=True)
            # It kept the job's directory from shadowing the snapshot in this process; a command
            # this rank starts (switchyard run) gets its script's directory on sys.path as usual.
            os.environ.pop("PYTHONSAFEPATH", None)
        try:
            return self.fn(*args, **kwargs)
        except SystemExit as e:
            if getattr(e, "stop_reason", None):  # the trainer's JobStopped, rank_env.AttemptNotOver
                mark_stopped(str(getattr(e, "stop_reason")))  # noqa: B009 (SystemExit has none)
            raise


def stopped_file(result_pickle: Path) -> Path:
    """Beside a rank's result file: written instead of a result when the rank left on a stop
    request (the trainer's JobStopped, a command's AttemptNotOver), so the submitting side tells
    a rank that stopped cleanly from one that died."""
    return result_pickle.with_suffix(".stopped")


def mark_stopped(reason: str) -> None:
    try:
        paths = submitit.JobEnvironment().paths
    except Exception:  # not a submitit job (debug mode): nobody waits on files
        return
    with contextlib.suppress(OSError):
        stopped_file(paths.result_pickle).write_text(reason)


def code_banner() -> str:
    """Where this rank's Switchyard code came from: the snapshot, or (a misconfigured PYTHONPATH
    that put a checkout first) a warning that names the directory it really came from."""
    snap, root = snapshot.current(), snapshot.own_root()
    if snap is not None and snapshot.imported_from(__file__):
        return f"switchyard: code snapshot {snap.hash[:16]} ({root})"
    return (f"switchyard: warning: the code snapshot is {snap.path if snap else None}, but orchestrator "
            f"was imported from {root}: something on PYTHONPATH comes before it")


@dataclass(frozen=True)
class CheckpointableRankEntry(RankEntry):
    """A RankEntry around a function with submitit's ``checkpoint()`` protocol. submitit asks
    ``hasattr(function, "checkpoint")`` on the time-limit signal: a plain RankEntry hid the user's
    hook, so such a job was never requeued. This one passes the call through and wraps what it
    returns (the submission to resume with) again, so the requeued job still says who it is."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        resumed = getattr(self.fn, "checkpoint")(*args, **kwargs)  # noqa: B009 (Callable has none)
        if resumed is not None:
            resumed.function = rank_entry(resumed.function)
        return resumed


def rank_entry(fn: Callable[..., Any]) -> RankEntry:
    """What ``submit`` queues: ``fn`` behind its rank banner, its checkpoint() hook kept."""
    if isinstance(fn, RankEntry):
        return fn
    return CheckpointableRankEntry(fn) if callable(getattr(fn, "checkpoint", None)) else RankEntry(fn)


def submit(executor: submitit.Executor, fn: Callable[..., R], *args: Any, **kwargs: Any
           ) -> submitit.Job[R]:
    """Queue ``fn`` on every rank; an sbatch refusal is one line naming sbatch's reason."""
    try:
        return executor.submit(rank_entry(fn), *args, **kwargs)
    except (FailedJobError, submitit.core.utils.FailedSubmissionError) as e:  # submitit raises either
        said = " ".join(line.removeprefix("sbatch: error: ").strip()
                        for line in str(e).splitlines() if "error" in line.lower())
        raise SubmissionError(f"sbatch refused the job, nothing was queued: {said or e}") from e


# How long SLURM accounting may stay silent about a job before the submitter says so.
ACCOUNTING_PATIENCE_S = 60.0
# The state StateWatch reports for a job squeue has forgotten whose ending accounting never told.
ENDED = "ENDED"
# States in which a job has not ended yet (submitit's list, plus the brief ones around a start).
STILL_GOING = frozenset({"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING",
                         "PREEMPTED", "CONFIGURING", "SUSPENDED", "RESIZING", "REQUEUE_HOLD"})


class StateWatch:
    """One SLURM job's state, read through a gap in accounting.

    sacct answers first. When it does not list the job (slurmdbd down, restarting or lagging:
    sacct prints its header alone), the controller does (``squeue -t all``); once squeue has
    forgotten the job too, its result files say whether every rank has finished (``ENDED``), and
    after ``patience_s`` it is taken as ended without them. When accounting has been silent for
    ``patience_s``, this says so once, on stderr, with what it goes by instead: before, such a
    job was taken as pending (UNKNOWN) and waited for in silence.
    """

    def __init__(self, job: submitit.Job[Any], patience_s: float = ACCOUNTING_PATIENCE_S) -> None:
        self.job = job
        self.patience_s = patience_s
        self._silent_since: float | None = None
        self._told = False

    def state(self) -> str:
        job_id = str(self.job.job_id)
        accounted = slurm_query.accounted_state(job_id)
        if accounted is not None:
            self._silent_since = None
            return accounted
        now = time.monotonic()
        self._silent_since = now if self._silent_since is None else self._silent_since
        silent_s = now - self._silent_since
        queued = slurm_query.controller_state(job_id)
        missing = [rank for rank, task in enumerate(_tasks(self.job))
                   if not task.paths.result_pickle.exists()]
        if queued is not None:
            state, seen = queued, f"squeue lists it {queued}"
        elif not missing or silent_s >= self.patience_s:
            state = ENDED
            seen = ("squeue no longer lists it; going by its result files" if not missing else
                    f"squeue no longer lists it, and ranks {missing} wrote no result: taken as ended")
        else:
            state, seen = "UNKNOWN", "squeue no longer lists it"
        if silent_s >= self.patience_s and not self._told:
            self._told = True
            print(f"switchyard: SLURM accounting has not answered about job {job_id} for "
                  f"{silent_s:.0f} s; {seen}", file=sys.stderr, flush=True)
        return state


def backoff(first_s: float = 0.25, factor: float = 1.5, most_s: float = 5.0) -> Iterator[float]:
    """Poll intervals: short at first, when a job on an idle cluster starts (or a short one ends)
    within a second or two, then longer, so a job pending for hours costs a query per
    ``most_s``. A fixed 5 s poll made every short job wait up to 5 s more than it ran."""
    wait = first_s
    while True:
        yield wait
        wait = min(most_s, wait * factor)


def watch_pending(job: submitit.Job[Any], never_starts: str, poll_s: float = 5.0,
                  patience_s: float = ACCOUNTING_PATIENCE_S,
                  on_wait: Callable[[str, str, str | None, float], None] | None = None) -> None:
    """Wait while a SLURM job is pending; one whose pending reason it can never meet (a limit
    below its request: ``slurm_request.UNSATISFIABLE``; a dependency never satisfied, or a hold:
    ``NEVER_RELEASED``) is cancelled, or left queued with
    ``cluster.never_starts=keep``, and reported instead of waited for forever. The state is read
    through gaps in accounting (``StateWatch``). ``on_wait(job_id, state, reason, waited_s)`` is
    told at each poll (``progress.Display.pending``)."""
    if not isinstance(job, submitit.SlurmJob):
        return
    watch, waits = StateWatch(job, patience_s), backoff(most_s=poll_s)
    began = time.monotonic()
    while (state := watch.state()) in ("PENDING", "UNKNOWN", "REQUEUED"):
        said = slurm_request.pending_reason(str(job.job_id))
        if on_wait is not None:
            on_wait(str(job.job_id), state, said, time.monotonic() - began)
        if slurm_request.can_never_start(said):
            reason = str(said)
            if never_starts == "keep":
                what = f"left it queued (cluster.never_starts=keep); scancel {job.job_id} removes it"
            else:
                job.cancel(check=False)
                what = "cancelled it (cluster.never_starts=keep leaves such a job queued)"
            raise SubmissionError(f"job {job.job_id} is pending for a reason it can never meet "
                                  f"({reason}): {slurm_request.why_never(reason)}; {what}")
        time.sleep(next(waits))


def wait_slurm(job: submitit.Job[Any], poll_s: float = 0.2, ask_every_s: float = 10.0,
               patience_s: float = ACCOUNTING_PATIENCE_S, until_ended: bool = False) -> None:
    """Wait until every rank of a SLURM job has written its result, or SLURM says the job has
    ended (asked every ``ask_every_s``, through gaps in accounting: ``StateWatch``). The result
    files are looked for every ``poll_s`` (a stat per rank), so a job's end is seen at once.
    submitit's own wait asks sacct alone and, while accounting is silent, waits forever for a rank that
    died without a result. ``until_ended``: a job that restarts inside its allocation
    (``cluster.restarts``) writes results again after a failed step, so only its end counts."""
    watch = StateWatch(job, patience_s)
    asked = -math.inf
    while until_ended or not all(task.paths.result_pickle.exists() for task in _tasks(job)):
        if time.monotonic() - asked >= ask_every_s:
            asked = time.monotonic()
            if watch.state() not in STILL_GOING:
                return
        time.sleep(poll_s)


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    result: Any = None
    error: str | None = None  # the rank's own traceback, when it raised
    no_output: str | None = None  # it never wrote a result: killed, or the job died around it
    stopped: str | None = None  # it left on a stop request (its reason), its checkpoint written


def _stopped(task: submitit.Job[Any]) -> str | None:
    try:
        return stopped_file(task.paths.result_pickle).read_text() or "stop request"
    except OSError:
        return None


def _tasks(job: submitit.Job[Any]) -> list[submitit.Job[Any]]:
    return list(job._sub_jobs) or [job]  # submitit keeps one sub-job per task of a multi-task job


LOCAL_DEATH = "ended without a result: killed (SIGKILL, the OOM killer, a crash) or exited early"


def wait_fail_fast(job: submitit.Job[Any], poll_s: float = 0.5, restarts: int = 0) -> list[tuple[int, str]]:
    """Wait for the job; in local mode, as soon as one rank has raised or died, stop the rest
    instead of letting them wait in a collective or the rendezvous. On SLURM, srun's
    --kill-on-bad-exit does that, and a cancel from here would record the job as CANCELLED
    instead of FAILED.

    Returns the local ranks seen to die without a result, as (rank, reason), in the order seen:
    the same shape as ``srun_task_failures``, so ``failure`` blames them, not the ranks this
    stopped. A rank that returns or raises writes its result before it exits, so a rank
    process gone with no result file died; so did a rank not running one poll after its peers
    were found (it died before any poll saw it). A job can end between two polls (a rank killed,
    its peer failing at once on the lost connection, the controller ending as soon as both have):
    then each rank seen at work that left no result died.
    """
    seen: dict[int, psutil.Process | None] = {}  # rank -> its process; None: gone before found
    started = False  # ranks were found at an earlier poll, so the controller has started them all
    died: list[tuple[int, str]] = []
    while isinstance(job, LocalJob) and not job.done():
        tasks = _tasks(job)
        if len(seen) < len(tasks):  # /proc is scanned only until every rank is accounted for
            found = local_jobs.ranks(int(job.job_id), job.paths.folder)
            seen.update(found)
            if started:  # the controller starts its ranks within milliseconds of each other
                for rank in range(len(tasks)):
                    seen.setdefault(rank, None)
            started = started or bool(found)
        died = _died(seen, tasks)
        if died or any(_raised(task) for task in tasks):
            stop_local(job)
            break
        time.sleep(poll_s)
    else:  # the job ended between two polls: a rank seen at work that left no result died
        if seen:
            died = _died(seen, _tasks(job))
    if isinstance(job, submitit.SlurmJob):
        wait_slurm(job, until_ended=restarts > 0)
    else:
        job.wait()
    return died


def _died(seen: Mapping[int, psutil.Process | None], tasks: Sequence[submitit.Job[Any]]
          ) -> list[tuple[int, str]]:
    """The ranks seen at work (or missed: None) that are gone without a result or a stop."""
    return [(rank, LOCAL_DEATH) for rank, process in seen.items()
            if rank < len(tasks) and (process is None or not local_jobs.alive(process))
            and not tasks[rank].paths.result_pickle.exists() and not _stopped(tasks[rank])]


def stop_local(job: LocalJob[Any]) -> None:
    """Stop every rank of a local job now: SIGKILL to the ranks (``local_jobs``, which explains
    why), after which the controller sees them exit and returns. Not submitit's cancel: its
    SIGINT ends the controller in a KeyboardInterrupt traceback on the user's terminal and marks
    the job INTERRUPTED, as if the user had pressed Ctrl-C."""
    local_jobs.kill(int(job.job_id))


def _raised(task: submitit.Job[Any]) -> bool:
    path = task.paths.result_pickle
    if not path.exists():
        return False
    try:
        outcome, _ = pickle_load(path)
    except Exception:  # half-written: look again at the next poll
        return False
    return bool(outcome == "error")


def rank_outcomes(job: submitit.Job[Any]) -> list[RankOutcome]:
    """Per-rank results of a job that has ended (``wait_fail_fast``)."""
    tasks = _tasks(job)
    outcomes = []
    for rank, task in enumerate(tasks):
        if not task.paths.result_pickle.exists() and (reason := _stopped(task)) is not None:
            outcomes.append(RankOutcome(rank, stopped=reason))
            continue
        if not task.paths.result_pickle.exists():
            # The job has ended: a missing result will not appear (submitit would wait 15 s per
            # rank for it). The rank was killed, or the job died before it could write one.
            outcomes.append(RankOutcome(rank, no_output=f"no result; log tail:\n"
                                        f"{log_tails(task.paths.stdout, task.paths.stderr, 10)}"))
            continue
        try:
            outcomes.append(RankOutcome(rank, result=task.result()))
        except FailedJobError as e:
            outcomes.append(RankOutcome(rank, error=str(e)))
        except UncompletedJobError as e:
            outcomes.append(RankOutcome(rank, no_output=str(e)))
    return outcomes


def results(job: submitit.Job[R], run_dir: Path | None = None, restarts: int = 0) -> list[R]:
    """Every rank's return value, or :class:`JobFailedError` naming who failed and why.

    ``run_dir`` holds the ranks' heartbeats (``heartbeat``): with it, a hang names the rank the
    others waited for. Debug jobs run in this process when asked for their result, and their
    exceptions propagate unchanged, so a debugger stops where the error happened.
    """
    if isinstance(job, submitit.DebugJob):
        return job.results()
    died = wait_fail_fast(job, restarts=restarts)
    outcomes = rank_outcomes(job)
    if all(o.error is None and o.no_output is None for o in outcomes):
        if any(o.stopped for o in outcomes):
            raise stopped(job, outcomes)
        return [o.result for o in outcomes]
    raise failure(job, outcomes, died, run_dir)


_STOPPED_LINE = re.compile(r"^.*\bstopped by [^\n]*$", re.MULTILINE)


def stopped(job: submitit.Job[Any], outcomes: list[RankOutcome]) -> JobStoppedError:
    """The report of a job its ranks left on a stop request: its state, and where it stopped as
    rank 0's log says (the trainer: ``stopped by PREEMPTED at step 676; checkpoint in DIR``)."""
    state = "CANCELLED" if isinstance(job, LocalJob) else stopped_state(final_state(job))
    try:
        said = _STOPPED_LINE.findall(_tasks(job)[0].paths.stdout.read_text(errors="replace"))
    except OSError:
        said = []
    where = said[-1].strip() if said else f"ranks {[o.rank for o in outcomes if o.stopped]} stopped " \
        f"on a stop request ({next(o.stopped for o in outcomes if o.stopped)})"
    return JobStoppedError(f"job {job.job_id} was stopped ({state}): {where}", str(job.job_id), state)


# Errors a rank raises because *another* rank went away: consequences, not causes.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL (error|communicator)|"
                        r"ProcessGroup\w* .*(timed out|aborted)|Socket Timeout|DistNetworkError|"
                        r"rank 0 stopped before training|after rank \d+ had failed")
def culprits_of(outcomes: list[RankOutcome], died: list[tuple[int, str]],
                hung: Sequence[int] = ()) -> list[RankOutcome]:
    """Which ranks caused the failure, strongest evidence first.

    0. the ranks a hang verdict names (``hung``): the others' errors are their timeouts;
    1. a rank killed by a signal (SIGKILL, the OOM killer, a segfault): srun reports it, and the
       ranks that then lose their connection to it raise errors that only describe the loss;
    2. a rank that raised an error of its own (not a lost peer);
    3. the first rank srun saw exit with an error;
    4. ranks that left no result at all: those whose log does not end in a lost peer, if any.
    """
    by_rank = {o.rank: o for o in outcomes}
    named = [by_rank[r] for r in hung if r in by_rank]
    signalled = [by_rank[r] for r, why in died if not why.startswith("exited") and r in by_rank]
    own_errors = [o for o in outcomes if o.error is not None and not _PEER_LOST.search(o.error)]
    first_exit = [by_rank[r] for r, _ in died[:1] if r in by_rank]
    raised = [o for o in outcomes if o.error is not None]
    for candidates in (named, signalled, own_errors, first_exit, raised):
        if candidates:
            return list(dict.fromkeys(candidates))  # unique, order kept
    silent = [o for o in outcomes if o.no_output is not None]
    # A sweep point's ranks that exited (a command's exit status) leave no result, only logs: a
    # rank whose log ends in a lost peer is the consequence of one whose log does not.
    return [o for o in silent if not _PEER_LOST.search(o.no_output or "")] or silent


def failure(job: submitit.Job[Any], outcomes: list[RankOutcome],
            died_locally: Sequence[tuple[int, str]] = (), run_dir: Path | None = None
            ) -> JobFailedError:
    died = [*died_locally, *srun_task_failures(job)]
    reasons = dict(died)
    lines = [f"job {job.job_id} failed ({final_state(job)}):"]
    hang = hang_verdict(outcomes, run_dir)
    where = hang_dumps.report(hang_dumps.read_dumps(run_dir), len(outcomes)) if hang and run_dir else None
    if hang is not None and not hang.ranks and where is not None and where.ranks:  # alive elsewhere
        hang = heartbeat.Verdict(where.ranks, {r: "the others waited for it" for r in where.ranks},
                                 where.summary)
    if hang is not None:
        lines.append(f"collective timeout: {hang.summary}.")
    if where is not None and run_dir is not None:
        lines.append(f"where each rank was ({hang_dumps.hang_dir(run_dir)}):")
        lines += [f"  {line}" for line in where.lines]
        hang_dumps.record(run_dir, hang.summary if hang else where.summary, where)
    culprits = culprits_of(outcomes, died, hang.ranks if hang else ())
    reporter = "Switchyard saw" if isinstance(job, LocalJob) else "srun reports"
    for o in culprits[:4]:
        node = node_of(job, o.rank)
        cause = f"{reporter} the task {reasons[o.rank]}; " if o.rank in reasons and o.error is None else ""
        if hang is not None and o.rank in hang.why:
            cause = f"{hang.why[o.rank]}. Its log ends: "
        who = f"rank {o.rank}{f' on node {node}' if node else ''}: "
        said = quoted(o.error or o.no_output or "").removeprefix(who)
        tail = _tail(said, 25)
        if hang is None and o.error is not None and _RANK_FAILED not in o.error:
            tail = headed(said, tail)  # a traceback: its exception first, not its tail's first line
        lines.append(f"{who}{cause}{tail}")
    others = sorted(set(range(len(outcomes))) - {o.rank for o in culprits})
    if culprits and others:
        lines.append(f"ranks {others} were stopped after rank {culprits[0].rank} failed.")
    lines.append(f"logs: {job.paths.folder}")
    return JobFailedError("\n".join(lines), str(job.job_id), [o.rank for o in culprits])


# An exception line of a traceback: the exception's (dotted) class name at the start of the line,
# then its message or nothing (``raise KeyError`` prints the bare name).
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*: .*|[A-Z]\w*:|"
                             r"[A-Z]\w*(?:Error|Exception|Interrupt|Exit|Iteration|Warning))")
# What Python prints under a traceback's source lines: 3.11's carets and tildes marking the
# failing expression.
_MARKERS = re.compile(r"\s*[\^~]+\s*")


def exception_line(text: str) -> str | None:
    """The last exception line of a traceback in ``text`` (``ValueError: bad batch``; for chained
    tracebacks, the one raised last), or None: skipping the markers 3.11 prints under source lines,
    blank lines and submitit's footer, none of which says what failed."""
    for line in reversed(text.splitlines()):
        if not line.strip() or _MARKERS.fullmatch(line):
            continue
        if _EXCEPTION_LINE.fullmatch(line.rstrip()):
            return line.rstrip()
    return None


def headed(error: str, tail: str) -> str:
    """``tail`` (the last lines of a rank's ``error``) under the error's exception line: the
    report's line for a rank read ``rank 0 on node n1: ^^^^^^^^`` when the tail began inside a
    3.11 traceback, and the error itself was 20 lines further down."""
    exception = exception_line(error)
    if exception is None or tail.startswith(exception):
        return tail
    return f"{exception}\n    {tail}"


def lost_a_peer(error: str) -> bool:
    """Whether a rank's error only says another rank went away (a consequence, not a cause)."""
    return _PEER_LOST.search(error) is not None


def hang_verdict(outcomes: Sequence[RankOutcome], run_dir: Path | None) -> heartbeat.Verdict | None:
    """The heartbeats' verdict when the failure is a collective that timed out; None otherwise."""
    if run_dir is None:
        return None
    if not (hang_dumps.asked(run_dir)  # a rank's collective timed out, whatever the others then said
            or any(hang_dumps.is_collective_timeout(o.error or o.no_output or "") for o in outcomes)):
        return None
    world = len(outcomes)
    return heartbeat.verdict([b for b in heartbeat.read_beats(run_dir) if b.rank < world], world)


def final_state(job: submitit.Job[Any]) -> str:
    """The job's state for a failure report. A local job that failed is FAILED whatever its
    controller's exit says; on SLURM, sacct records the end a moment after the ranks' results
    appear, so it is asked (briefly) rather than printing a stale RUNNING."""
    if isinstance(job, LocalJob):
        return "FAILED"
    try:
        states = slurm_query.wait_for_terminal_states([str(job.job_id)], timeout_s=20)
    except slurm_query.SlurmQueryError:
        return job.state
    state = states.get(str(job.job_id))
    return state if state in slurm_query.TERMINAL_STATES else job.state


def srun_task_failures(job: submitit.Job[Any]) -> list[tuple[int, str]]:
    """(rank, reason) for tasks srun saw die on their own, in the order srun reported them.

    Once a task fails, srun (--kill-on-bad-exit) logs "Terminating StepId=..." and stops the rest:
    whatever it reports after that line ("Terminated", or "Killed" for a rank that outlived
    KillWait) is a consequence, not a cause, and is left out.
    """
    try:
        text = _tasks(job)[0].paths.stderr.read_text(errors="replace")  # the batch script's stderr
    except OSError:
        return []
    return [(rank, reason.lower()) for _node, rank, reason in bad_nodes.srun_errors(text)]


_NODE = re.compile(r"switchyard: rank \d+/\d+ on node (\S+)")


def node_of(job: submitit.Job[Any], rank: int) -> str | None:
    """The node a rank ran on, from the first line submitit writes to the rank's log."""
    tasks = _tasks(job)
    if rank >= len(tasks):
        return None
    try:
        with open(tasks[rank].paths.stdout) as f:
            match = _NODE.search(f.read(8192))
    except OSError:
        return None
    return match.group(1) if match else None


def log_tails(stdout: Path, stderr: Path, lines: int) -> str:
    """The last lines of both of a rank's logs (submitit keeps them apart): a killed rank's last
    words are often prints on stdout while its stderr is empty, which read as "(empty)" alone."""
    tails = [f"{path.name}:\n    {tail}" for path in (stdout, stderr) if (tail := _read_tail(path, lines))]
    return "\n".join(tails) or f"(empty: {stdout.name} and {stderr.name} hold nothing)"


def _read_tail(path: Path, lines: int) -> str:
    try:
        return _tail(path.read_text(errors="replace"), lines)
    except OSError:
        return "(no log)"


def _tail(text: str, lines: int) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n    ".join(kept)
