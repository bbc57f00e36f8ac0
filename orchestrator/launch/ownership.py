"""Who may use a run directory: the one rule every entry point asks before it submits.

A run directory belongs to one run. A submission may use a directory that is

- new, or empty (but for what is written there before a run claims it: Hydra's ``.hydra/`` and
  the job's ``NAME.log``, ``signal_delay.json``; so a dry run or a refused run leaves nothing that
  blocks the next);
- or a Switchyard run's own (its marker, ``RUN/.switchyard/run.json``; runs from before the marker:
  ``RUN/.switchyard/config.yaml`` or ``RUN/.switchyard.lock``) that no live run holds: continuing a
  stopped or finished run with the same ``hydra.run.dir`` is how a run is resumed by hand.

Anything else is refused before submission, naming what is there: a folder of the user's own
``summary.json`` and ``metrics.jsonl`` was replaced without a word, and ``hydra.run.dir=/`` wrote
``checkpoints/`` into the file system's root. An empty path is refused too (it is the working
directory).

A run is live while rank 0 holds the directory's lock (``run_lock``), while its job is queued or
running (the registry the marker names, asked as ``switchyard status`` asks), or, before the job is
recorded, while the submitting process is alive (same host). A run queued but not started holds no
lock: two submissions in one second shared ``outputs/DATE/HH-MM-SS``, and the second resumed the
first's checkpoint or failed after its queue wait. Default directories are now unique by
construction (the submission's time to the microsecond and its pid: ``conf/train.yaml``,
``conf/run.yaml``), so two submissions meet only where the user named one directory; there the
claim (:func:`claim`, under a lock) refuses the second before it is submitted, naming both runs.
A sweep's points must each have their own directory (:class:`SweepDirs`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from durable import atomic
from orchestrator.config import ConfigError
from orchestrator.launch import run_lock, signal_delay

FILES = ".switchyard"  # Switchyard's own files in a run directory (a sweep point's, a single job's)
MARKER = f"{FILES}/run.json"  # who submitted the run, and its job once recorded
_LEGACY_MARKERS = (f"{FILES}/config.yaml", run_lock.LOCK_NAME)  # runs from before the marker
_CLAIM_LOCK = f"{FILES}/claim.lock"
# Written into a run directory before the run claims it, so a run refused after them leaves them:
# Hydra's own files (with the job's log) before the app runs, and the signal lead time chosen as a
# SLURM point or job is prepared. They do not make a directory someone else's.
BEFORE_CLAIM = (".hydra", signal_delay.CHOICE_FILE)
# What the other ranks of the user's own srun/torchrun (an attached launch) may write into a new run
# directory before rank 0 claims it: their Hydra's files, and telemetry's rank records and samples.
ATTACHED_RANKS_OWN = ("telemetry",)
_SHOWN = 6  # entries named in a refusal


class RunDirInUseError(run_lock.RunDirInUseError):
    """A live run owns the directory (queued, running, or being submitted)."""


@dataclass(frozen=True)
class Claimant:
    """Who claims a run directory: one submission, as another run's refusal names it."""

    command: str  # what was typed, e.g. "train optim.lr=0.1"
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    at: float = field(default_factory=time.time)

    @classmethod
    def of(cls, app: str, overrides: Sequence[str]) -> Claimant:
        return cls(" ".join([app, *map(str, overrides)]).strip())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.at))
        return f"`{self.command}` (submitted {when} by pid {self.pid} on {self.host})"


def check_path(text: str, key: str) -> None:
    """An empty path is the working directory: refused, with the fix."""
    if not text.strip():
        raise ConfigError(f"{key}={text!r} is invalid: an empty path is the working directory, where the "
                          f"run would write its files among yours (try {key}=<a new directory>, or "
                          f"leave {key} unset for its default)")


def check(run_dir: Path, this: Claimant, key: str = "hydra.run.dir", hydra_log: str | None = None,
          ignored: Sequence[str] = ()) -> None:
    """Refuse now, before anything is written or submitted, a directory this run may not use:
    one holding files that are not a Switchyard run's, or a run's that a live run holds.
    ``hydra_log``: the log file Hydra writes there itself (``train.log``); ``ignored``: other
    entries this run's own processes may have written already."""
    entries = _entries(run_dir, key)
    if entries is None:
        return  # new
    if is_run_dir(run_dir):
        refuse_if_live(run_dir, this, key)
        return
    foreign = sorted(e for e in entries if e not in (*BEFORE_CLAIM, hydra_log, *ignored))
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN
                                               else "")
        raise ConfigError(f"{key}={str(run_dir)!r} holds files that are not a Switchyard run's: {shown}; "
                          f"the run would write its summary.json, metrics.jsonl, checkpoints/ and logs "
                          f"there, over any of the same name, so nothing was submitted (try {key}=<a new "
                          f"or empty directory>)")


@dataclass
class SweepDirs:
    """A sweep's points' run directories, each checked as its point is resolved, before anything
    is written there: its own (points sharing one overwrote each other's config at submission,
    so point #0 trained with point #1's, then each other's checkpoints), and one :func:`check`
    accepts."""

    this: Claimant
    seen: dict[Path, str] = field(default_factory=dict)  # run directory -> the point that has it

    def check(self, name: str, run_dir: Path, key: str = "hydra.sweep.subdir") -> None:
        """``name``'s ``run_dir``; the error leaves the point's name to the caller."""
        run_dir = Path(run_dir).absolute()
        if (other := self.seen.get(run_dir)) is not None:
            raise ConfigError(f"its run directory {str(run_dir)!r} is {other}'s too: each point needs its "
                              f"own, or they overwrite each other's config and checkpoints; nothing was "
                              f"submitted (try {key}=${{hydra.job.num}}, the default, or a {key} that "
                              f"differs between the points)")
        self.seen[run_dir] = name
        check(run_dir, self.this, key)


def is_run_dir(run_dir: Path) -> bool:
    """A Switchyard run's own directory (its marker, or an older run's files)."""
    return any((run_dir / name).exists() for name in (MARKER, *_LEGACY_MARKERS))


def refuse_if_live(run_dir: Path, this: Claimant, key: str) -> None:
    holder = live_owner(run_dir)
    if holder is not None:
        raise RunDirInUseError(
            f"{key}={str(run_dir)!r} is in use by {holder}; this run, {this.describe()}, would "
            f"overwrite its checkpoints and metrics, so nothing was submitted (try {key}=<a new "
            f"directory>, or wait until that run ends to continue it there)")


def claim(run_dir: Path, this: Claimant, key: str = "hydra.run.dir") -> None:
    """Make ``run_dir`` this submission's, before anything is submitted: refused if a live run
    holds it. Under a lock, so of two submissions naming one directory at once the second sees the
    first (its submitting process alive) and is refused."""
    with _claim_lock(run_dir):
        refuse_if_live(run_dir, this, key)
        atomic.write_json(run_dir / MARKER, {"submission": asdict(this)}, indent=1, durable=False)


def record_job(run_dir: Path, registry: Path, sweep_id: int, num: int, job_id: str | None,
               this: Claimant | None = None) -> None:
    """The marker names the run's job once the registry has it: from then on the registry says
    whether it is live (queued, running), whatever became of the submitting process."""
    marker = _read_marker(run_dir)
    submission = asdict(this) if this is not None else marker.get("submission")
    job = {"registry": str(Path(registry).absolute()), "sweep_id": sweep_id, "num": num, "job_id": job_id}
    atomic.write_json(run_dir / MARKER, {"submission": submission, "job": job}, indent=1, durable=False)


def live_owner(run_dir: Path) -> str | None:
    """Who holds ``run_dir`` now, or None: rank 0's lock, a queued or running job, a submission
    still at work."""
    if (holder := run_lock.holder(run_dir)) is not None:
        return holder
    marker = _read_marker(run_dir)
    submission = marker.get("submission") if isinstance(marker.get("submission"), dict) else None
    command = f", submitted as `{submission.get('command')}`" if submission else ""
    job = marker.get("job")
    if isinstance(job, dict):
        state = _job_state(job)
        if state is None:
            return None
        ref, job_id = f"{job.get('sweep_id')}/{job.get('num')}", job.get("job_id")
        return f"switchyard job {ref} ({f'id {job_id}, ' if job_id else ''}{state}{command})"
    if submission is not None and _alive_here(submission):
        return f"a submission still at work, {Claimant(**submission).describe()}"
    return None


def _job_state(job: dict[str, Any]) -> str | None:
    """The job's state when it is queued or running; None when it ended or cannot be known."""
    from orchestrator.launch import slurm_query
    from orchestrator.registry.db import Registry, RegistryError
    from orchestrator.registry.reconciliation import reconcile
    from orchestrator.registry.states import TERMINAL_STATES

    path, sweep_id, num = Path(str(job.get("registry"))), job.get("sweep_id"), job.get("num")
    if not (path.is_file() and isinstance(sweep_id, int) and isinstance(num, int)):
        return None
    try:
        with Registry(path) as registry:
            reconcile(registry, [sweep_id], [num], ask_slurm=slurm_query.query_states)
            attempt = registry.latest_attempts(sweep_id).get(num)
    except (RegistryError, sqlite3.Error, OSError, ValueError, LookupError):
        return None  # a registry that cannot say: the lock still guards a running run
    if attempt is None or attempt.state in TERMINAL_STATES:
        return None
    return attempt.state


def _alive_here(submission: dict[str, Any]) -> bool:
    pid = submission.get("pid")
    if submission.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that pid
    return True


def _read_marker(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _entries(run_dir: Path, key: str) -> list[str] | None:
    """What ``run_dir`` holds; None when it does not exist."""
    try:
        return os.listdir(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None  # a file on the way: making the directory says so (entry.describe)
    except OSError as e:
        raise ConfigError(f"{key}={str(run_dir)!r} cannot be used: {e.strerror or e} (try {key}=<a "
                          f"directory you can write>)") from e


@contextlib.contextmanager
def _claim_lock(run_dir: Path) -> Iterator[None]:
    try:
        (run_dir / FILES).mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / _CLAIM_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {str(run_dir)!r}: {e.strerror or e} (try "
                          f"a directory you can write)") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for the few milliseconds of another claim
        yield
    finally:
        os.close(fd)


class RunDirCheck:
    """A Hydra callback (``hydra.callbacks.run_dir`` in ``conf/train.yaml`` and ``conf/run.yaml``):
    :func:`check` on ``hydra.run.dir`` at ``on_run_start``, before Hydra makes the directory and
    writes ``.hydra/`` and its log there. Not on a sweep (the launcher checks every point) nor on
    an attached launch's other ranks (rank 0 checks for all)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from orchestrator.entry import RefusedBeforeStart
        from orchestrator.launch import dist_env

        launch = dist_env.attached_launch()
        if dist_env.inside_launched_job() or (launch is not None and not launch.is_main):
            return
        name = str(OmegaConf.select(config, "hydra.job.name", default="") or "")
        try:
            run_dir = str(OmegaConf.select(config, "hydra.run.dir"))
            check_path(run_dir, "hydra.run.dir")
            check(Path(run_dir).absolute(), submission_of(config), hydra_log=f"{name}.log",
                  ignored=ATTACHED_RANKS_OWN if launch is not None else ())
        except ConfigError as e:
            raise RefusedBeforeStart(str(e)) from e

    # Hydra calls every event on every callback
    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None: ...
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None: ...
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None: ...
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None: ...
    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None: ...


def submission_of(config: DictConfig) -> Claimant:
    """This Hydra run as another run's refusal names it: the app and the overrides typed."""
    name = str(OmegaConf.select(config, "hydra.job.name", default="") or "")
    return Claimant.of(name, OmegaConf.select(config, "hydra.overrides.task", default=None) or [])
