"""One owner for a single job's submission: the order every entry point takes, written once.

``jobs.train``, ``switchyard run`` and ``switchyard.submit`` each build a :class:`Submission`
(what runs, where, with which checks) and call its ``run``, which takes the same steps in the same
order for all of them:

1. ``run_dir: PATH`` is said first (when the entry announces);
2. the run directory is checked (``ownership``: new, empty, or a Switchyard run's own that no live
   run holds), before anything is written there (Hydra's apps: by its callback, before Hydra wrote);
3. the time-limit signal's lead time is chosen (``signal_delay``: ``auto`` reads the last run here),
   the run directory is claimed, and any other directory two runs must not share
   (``checkpoint.dir``) is checked free (``run_lock``): nothing else is done for a refused run;
4. the entry's own checks run (``Submission.check``), and return the :class:`Plan`: what each rank
   runs, which modules and scripts it imports, what a container must mount;
5. the code snapshot and ``provenance.json`` (``provenance.at_submission``);
6. the executor for the mode (``submit.make_executor``);
7. a dry run prints what would be queued and stops here, having queued and created nothing else;
8. the plan's last words before the queue (``Plan.before_submit``: the memory line, run files);
   ``switchyard run`` in debug mode then runs its command here instead (``Plan.in_process``);
9. the job is queued (``submit.submit``), then recorded in the registry (``single``);
10. unless the entry follows the job itself, it is followed to its end (``single.follow``).

A new entry point (a search's trials, a restart) is one more ``Submission``; a new step of every
submission is one more line here. ``tests/orchestrator/launch/test_submission.py`` pins the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import submitit

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import container, ownership, provenance, run_lock, signal_delay, single, submit

R = TypeVar("R")

SUBMITIT_DIR = "submitit"  # RUN/submitit: the job's pickles and every rank's log


@dataclass(frozen=True)
class Plan(Generic[R]):
    """What the entry's checks decided the job runs: ``fn(*args)`` on every rank."""

    fn: Callable[..., R]
    args: tuple[Any, ...]
    config_yaml: str  # the resolved config: the snapshot's, the registry's and ``show``'s record
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: Sequence[str] = ()  # modules whose code the snapshot must hold
    scripts: Sequence[Path] = ()  # Python files a command runs (their imports are recorded)
    mounts: Sequence[container.Need] = ()  # the paths a container must mount, by config key
    rank_modules: Sequence[str] = ()  # imported once per node before the ranks fork
    own_code: bool = False  # each rank's process runs Switchyard's code only (job_entry)
    dry_run_preface: str | None = None  # printed before the dry run's script (the memory table)
    before_submit: Callable[[], None] | None = None  # the last words before the queue
    in_process: Callable[[], list[R]] | None = None  # run here, no executor (switchyard run's debug mode)


@dataclass(frozen=True)
class Submission(Generic[R]):
    """One job an entry point asks for; ``run`` submits it."""

    app: str  # the registry's name for the entry point: train, run, function
    command: str  # the command line the registry shows
    run_dir: Path
    cluster: ClusterConfig
    parallelism: ParallelismConfig
    overrides: Sequence[str]
    check: Callable[[ClusterConfig], Plan[R]]  # the entry's checks, given the cluster as submitted
    held: Sequence[tuple[Path, str]] = ()  # (directory, config key) besides the run directory
    announce: bool = True  # print run_dir, the signal delay's choice and the job's id
    follow: bool = True  # wait for the end here (switchyard.submit returns the job instead)
    total_steps: int | None = None  # the steps it trains, for status's STEP column (jobs.train)
    key: str = "hydra.run.dir"  # the setting that named ``run_dir``, for a refusal's fix
    # Hydra's apps had it checked before Hydra wrote there (``ownership.RunDirCheck``, a callback)
    dir_checked: bool = True
    claimed_as: Sequence[str] | None = None  # how another run's refusal names it (default: overrides)
    into: single.Into | None = None  # recorded as this job of an existing sweep (a search's trial)

    def run(self) -> Submitted[R]:
        """Steps 1-10 of the module's docstring, in that order."""
        run_dir = self.run_dir
        if self.announce:
            print(f"run_dir: {run_dir}", flush=True)
        named = self.overrides if self.claimed_as is None else self.claimed_as
        claimant = ownership.Claimant.of(self.app, named)
        if not self.dir_checked:  # before anything is written there
            ownership.check(run_dir, claimant, self.key)
        cluster = signal_delay.at_submission(self.cluster, run_dir, announce=self.announce)
        # The directory is this run's from here (a dry run's too: it writes provenance.json there,
        # and the real run after it must find its own directory): a second submission is refused.
        ownership.claim(run_dir, claimant, self.key)
        for directory, key in self.held:
            run_lock.check_free(directory, key)
        plan = self.check(cluster)
        if plan.in_process is not None:
            if plan.before_submit is not None:
                plan.before_submit()
            return Submitted(plan, cluster, results=plan.in_process())
        code = provenance.at_submission(cluster, plan.targets, run_dir, plan.config_yaml, plan.scripts)
        folder = run_dir / SUBMITIT_DIR
        executor = submit.make_executor(cluster, self.parallelism, folder, code, plan.mounts,
                                        plan.rank_modules, own_code=plan.own_code)
        if cluster.dry_run:
            if plan.dry_run_preface is not None:  # before the script, which stays the output's tail
                print(f"{plan.dry_run_preface}\n")
            print(submit.dry_run_text(executor, folder), end="")
            return Submitted(plan, cluster)
        if plan.before_submit is not None:
            plan.before_submit()
        with single.submitting(cluster, run_dir):  # a local job not waited for: its own output file
            job = submit.submit(executor, plan.fn, *plan.args, **plan.kwargs)
        recorded = single.record_submitted(self.app, self.command, job, run_dir, list(self.overrides),
                                           plan.config_yaml, self.parallelism, announce=self.announce,
                                           total_steps=self.total_steps, into=self.into)
        done = Submitted(plan, cluster, job, recorded)
        if self.follow:
            done.results = single.follow(cluster, recorded, job, run_dir, self.total_steps)
        return done


@dataclass
class Submitted(Generic[R]):
    """What ``Submission.run`` leaves: the job and its registry row (None for a dry run or debug),
    and every rank's result where it was followed to its end."""

    plan: Plan[R]
    cluster: ClusterConfig
    job: submitit.Job[R] | None = None
    recorded: single.Recorded | None = None
    results: list[R] | None = field(default=None)


