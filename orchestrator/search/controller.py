"""The search's controller: an asynchronous ask/tell loop over Optuna whose trials are jobs.

Each poll (``SearchSettings.poll_s``):

1. the registry is reconciled with SLURM (or the local process table), as ``switchyard status`` does;
2. every running trial's new intermediate values (``metrics``) are reported to Optuna; a trial its
   pruner stops is cancelled as ``switchyard cancel`` cancels (its checkpoint kept) and recorded
   PRUNED; a trial whose job ended is told its value, or failed with its cause (a NaN, a failed job,
   no objective written): the search goes on;
3. while fewer than ``n_jobs`` trials run and fewer than ``n_trials`` were asked, the next trial is
   asked and its job submitted at once: trials start as others end, never in batches.

Everything the loop knows is on disk: Optuna's journal in the sweep directory, the registry's
``trials`` rows and the jobs' files. A controller killed at any point is resumed by
:func:`resume`: running trials are adopted (not resubmitted), ended ones are not rerun, and the
budget counts every trial already asked. A trial asked but never submitted (the controller died
in between) is submitted then: it never ran.

What a trial runs is the app's business (``jobs.train``): the controller finds the app's
``search_check`` and ``search_submit`` by module name (:class:`TrialApp`), as it is recorded in
the registry, so ``switchyard search resume`` submits the same app's jobs.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

import optuna
from optuna.trial import TrialState

from orchestrator.config import ConfigError
from orchestrator.launch import cancel, local_jobs, slurm_query
from orchestrator.launch.single import Into
from orchestrator.registry.db import Attempt, Registry, Trial
from orchestrator.registry.reconciliation import reconcile
from orchestrator.registry.states import FINAL_STATES, PRUNED
from orchestrator.search import metrics, space, study
from orchestrator.search.settings import SearchSettings

RUNNING, COMPLETED, FAILED = "RUNNING", "COMPLETED", "FAILED"  # a trial's states, with PRUNED
LOCK_FILE = "controller.lock"


class SearchError(RuntimeError):
    """The search cannot go on (another controller holds it, the objective is never written)."""


@dataclass(frozen=True)
class TrialShape:
    """What the app's check learned of a trial's config: where it runs and when it reports."""

    executor: str  # local | slurm: the registry's executor of the search's sweep
    first_step: int  # the first intermediate value's step (eval_every_steps; 0: none before the end)
    last_step: int  # the trial's last step (optim.max_steps)


class TrialApp(Protocol):
    """What an app provides to be searched (``jobs.train`` does)."""

    def search_check(self, overrides: list[str]) -> TrialShape: ...

    def search_submit(self, overrides: list[str], run_dir: Path, into: Into) -> None: ...


def load_app(module: str) -> TrialApp:
    """The app by its module name; the running ``python -m`` module itself where it is that one
    (importing it again would make a second copy of its module state)."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(getattr(main, "__spec__", None), "name", None) == module:
        found: Any = main
    else:
        found = importlib.import_module(module)
    if not (hasattr(found, "search_check") and hasattr(found, "search_submit")):
        raise ConfigError(f"{module} cannot be searched: it defines no search_check and search_submit "
                          f"(python -m jobs.train -m hydra/sweeper=switchyard_optuna ...)")
    return cast(TrialApp, found)


@dataclass(frozen=True)
class Plan:
    """A search checked and ready: nothing is submitted until :func:`start` runs it."""

    settings: SearchSettings
    base: list[str]  # the overrides every trial has
    app: str  # the module whose search_check and search_submit run the trials
    shape: TrialShape
    searched: dict[str, optuna.distributions.BaseDistribution]
    fixed: dict[str, Any]


def check(settings: SearchSettings, base: Sequence[str], app: str) -> Plan:
    """Everything that can be refused before anything is submitted, each refusal one line naming
    the key: the search space, each parameter against the app's config, a pruner with nothing to
    prune on."""
    searched, fixed = space.parse(settings.params)
    trial_app = load_app(app)
    shape = trial_app.search_check(list(base))
    for key, dist in searched.items():  # each key alone, so the error names the one at fault
        try:
            trial_app.search_check([*base, *space.overrides({key: _some_value(dist)}, fixed)])
        except ConfigError as e:
            raise ConfigError(f"{space.PREFIX}{key}={settings.params[key]!r}: {e}") from e
    if settings.pruner != "none" and shape.first_step <= 0 and settings.objective.startswith("eval_"):
        raise ConfigError(f"hydra.sweeper.pruner={settings.pruner!r} has no intermediate values to prune "
                          f"on: eval_every_steps=0 evaluates only at the end (try eval_every_steps="
                          f"{max(shape.last_step // 10, 1)}, or hydra.sweeper.pruner=none)")
    return Plan(settings, list(base), app, shape, searched, fixed)


def _some_value(dist: optuna.distributions.BaseDistribution) -> Any:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return dist.choices[0]
    return getattr(dist, "low")  # noqa: B009 -- Int and Float distributions alike


def start(plan: Plan, registry: Registry, sweep_dir: Path, app_name: str, command: str,
          out: IO[str] = sys.stdout) -> int:
    """Record the search as a sweep and run it to its end; returns the sweep id."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    sweep_id = registry.create_sweep(app=app_name, command=command, sweep_dir=str(sweep_dir),
                                     executor=plan.shape.executor, entry_path="")
    registry.record_search(sweep_id, str(sweep_dir / study.STUDY_FILE), {
        "settings": plan.settings.as_dict(), "base": plan.base, "app": plan.app})
    print(f"search: {sweep_id} (switchyard status {sweep_id}; resume a killed controller with "
          f"switchyard search resume {sweep_id})\nsweep_dir: {sweep_dir}", file=out, flush=True)
    Controller(registry, sweep_id, sweep_dir, plan, out).run()
    return sweep_id


def resume(registry: Registry, sweep_id: int, out: IO[str] = sys.stdout) -> None:
    """Pick up a search whose controller stopped: the same study, trials and registry rows."""
    found = registry.search(sweep_id)
    if found is None:
        raise SearchError(f"sweep {sweep_id} is not a search (switchyard status {sweep_id} shows what it is)")
    _, recorded = found
    settings = SearchSettings.from_dict(recorded["settings"])
    searched, fixed = space.parse(settings.params)
    shape = load_app(recorded["app"]).search_check(list(recorded["base"]))
    plan = Plan(settings, list(recorded["base"]), recorded["app"], shape, searched, fixed)
    Controller(registry, sweep_id, Path(registry.sweep(sweep_id).sweep_dir), plan, out).run()


@contextlib.contextmanager
def held(sweep_dir: Path) -> Iterator[None]:
    """One controller per search: an exclusive lock on a file of its sweep directory, which the
    kernel releases when its holder dies, however it dies."""
    with open(sweep_dir / LOCK_FILE, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            f.seek(0)
            raise SearchError(f"another controller is running this search (pid {f.read().strip() or '?'}): "
                              f"stop it first, or leave it to finish") from e
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield


class Controller:
    def __init__(self, registry: Registry, sweep_id: int, sweep_dir: Path, plan: Plan, out: IO[str]) -> None:
        self.registry, self.sweep_id, self.sweep_dir = registry, sweep_id, sweep_dir
        self.plan, self.out = plan, out
        self.settings = plan.settings
        self.study = study.open_study(sweep_dir, plan.settings, max(plan.shape.first_step, 1),
                                      plan.shape.last_step)
        self.app = load_app(plan.app)

    def run(self) -> None:
        with held(self.sweep_dir):
            while self.poll():
                time.sleep(self.settings.poll_s)
        self.say(self.best_line())

    def poll(self) -> bool:
        """One round of the module docstring's steps; False once every trial has ended."""
        for warning in reconcile(self.registry, [self.sweep_id], ask_slurm=slurm_query.query_states).warnings:
            print(f"warning: {warning}", file=sys.stderr)
        attempts = self.registry.latest_attempts(self.sweep_id)
        frozen = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        recorded = {t.num for t in self.registry.trials(self.sweep_id)}
        for number, known in frozen.items():  # asked, then the controller stopped before recording it
            if known.state == TrialState.RUNNING and number not in recorded:
                self.registry.record_trial(Trial(self.sweep_id, number, dict(known.params), RUNNING, None,
                                                 None, None, time.time()))
        for trial in self.registry.trials(self.sweep_id):
            if trial.state != RUNNING:
                continue
            attempt = attempts.get(trial.num)
            if attempt is None:  # asked, never submitted: the controller stopped in between
                self.submit(trial)
            else:
                self.follow(trial, attempt, frozen[trial.num])
        live = sum(t.state == RUNNING for t in self.registry.trials(self.sweep_id))
        asked = len(self.study.get_trials(deepcopy=False))
        for _ in range(min(self.room(live), self.settings.n_trials - asked)):
            self.ask()
            live += 1
        return live > 0

    def room(self, live: int) -> int:
        """How many trials to ask now: a free slot is filled at once (``bench/search_bench.py``'s
        batch-shaped variant waits for the whole batch instead, as Hydra's sweepers do)."""
        return self.settings.n_jobs - live

    # -- a new trial ------------------------------------------------------------------------------

    def ask(self) -> None:
        trial = self.study.ask(self.plan.searched)
        row = Trial(self.sweep_id, trial.number, dict(trial.params), RUNNING, None, None, None, time.time())
        self.registry.record_trial(row)  # before the job: a controller dying next submits it on resume
        self.submit(row)

    def submit(self, trial: Trial) -> None:
        overrides = [*self.plan.base, *space.overrides(trial.params, self.plan.fixed)]
        run_dir = self.sweep_dir / str(trial.num)
        into = Into(self.registry.path, self.sweep_id, trial.num, self.plan.shape.last_step)
        try:
            self.app.search_submit(overrides, run_dir, into)
        except Exception as e:  # a refused value, a refused sbatch: this trial fails, the search goes on
            self.fail(trial, f"not submitted: {type(e).__name__}: {e}".splitlines()[0][:500])
            return
        shown = " ".join(space.overrides(trial.params, {}))
        self.say(f"trial {trial.num} submitted: {shown} (job {self.sweep_id}/{trial.num}, run_dir {run_dir})")

    # -- a running trial ----------------------------------------------------------------------------

    def follow(self, trial: Trial, attempt: Attempt, frozen: optuna.trial.FrozenTrial) -> None:
        run_dir = self.sweep_dir / str(trial.num)
        if frozen.state != TrialState.RUNNING:  # told before the controller stopped, not yet recorded
            self.record_told(trial, frozen, attempt)
            return
        found = metrics.windows(run_dir, self.settings.objective)
        live = optuna.trial.Trial(self.study, frozen._trial_id)
        for window in found:
            if window.step in frozen.intermediate_values:
                continue
            if math.isnan(window.value):
                self.stop(trial, attempt, "FAILED", f"{self.settings.objective} is NaN at step {window.step}")
                return
            live.report(window.value, window.step)
        last = found[-1] if found else None
        # asked every time, an ended trial too: successive halving and Hyperband record a trial's
        # value at each rung it passed when asked, and later trials are judged against those
        behind = last is not None and self.settings.pruner != "none" and live.should_prune()
        if attempt.state == PRUNED:  # cancelled as pruned; the controller stopped before telling
            self.prune(trial, attempt, last, cancelled=True)
        elif attempt.state in FINAL_STATES:
            self.finish(trial, attempt, last)
        elif behind:
            self.prune(trial, attempt, last, cancelled=False)

    def finish(self, trial: Trial, attempt: Attempt, last: metrics.Window | None) -> None:
        key = self.settings.objective
        if attempt.state != COMPLETED:
            self.fail(trial, f"job {attempt.state}: {attempt.error or 'no cause recorded'}", attempt)
            return
        if last is None:
            self.fail(trial, f"its job completed without writing {key} to metrics.jsonl")
            raise SearchError(f"hydra.sweeper.objective={key!r}: trial {trial.num} completed without "
                              f"writing it to {self.sweep_dir / str(trial.num) / metrics.METRICS_FILE} "
                              f"(try hydra.sweeper.objective=eval_loss)")
        self.study.tell(trial.num, last.value)
        self.registry.record_trial(Trial(self.sweep_id, trial.num, trial.params, COMPLETED, last.step,
                                         last.value, None, time.time()))
        self.say(f"trial {trial.num} COMPLETED: {key}={last.value:.6g} at step {last.step}; "
                 f"{self.best_line()}")

    def prune(self, trial: Trial, attempt: Attempt, last: metrics.Window | None, cancelled: bool) -> None:
        step, value = (last.step, last.value) if last else (None, None)
        if not cancelled:
            where = f"the search's pruner at step {step}, value {value:.6g}" if last else \
                "the search's pruner"
            stopped = cancel.cancel(self.registry, self.sweep_id, trial.num, local_jobs.KILL_WAIT_S,
                                    where, state=PRUNED).attempts
            if not stopped:  # it ended before the cancel reached it: its end is told next poll
                return
        self.study.tell(trial.num, state=TrialState.PRUNED)
        self.registry.record_trial(Trial(self.sweep_id, trial.num, trial.params, PRUNED, step, value, None,
                                         time.time()))
        self.say(f"trial {trial.num} PRUNED at step {step}, value {value:.6g} (checkpoint kept in its "
                 f"run_dir)"
                 if last else f"trial {trial.num} PRUNED")

    def stop(self, trial: Trial, attempt: Attempt, state: str, why: str) -> None:
        """A running trial failed by what it wrote (a NaN): its job stopped, its checkpoint kept."""
        if attempt.state not in FINAL_STATES:
            cancel.cancel(self.registry, self.sweep_id, trial.num, local_jobs.KILL_WAIT_S,
                          f"the search: {why}")
        self.fail(trial, why)

    def fail(self, trial: Trial, why: str, attempt: Attempt | None = None) -> None:
        self.study.tell(trial.num, state=TrialState.FAIL)
        self.registry.record_trial(Trial(self.sweep_id, trial.num, trial.params, FAILED, None, None, why,
                                         time.time()))
        self.say(f"trial {trial.num} FAILED: {why} (the search goes on)")

    def record_told(self, trial: Trial, frozen: optuna.trial.FrozenTrial, attempt: Attempt) -> None:
        """Optuna was told, the registry not yet (a controller killed in between): write it down."""
        state = {TrialState.COMPLETE: COMPLETED, TrialState.PRUNED: PRUNED}.get(frozen.state, FAILED)
        step = max(frozen.intermediate_values, default=None)
        value = frozen.value if frozen.state == TrialState.COMPLETE else \
            frozen.intermediate_values.get(step) if step is not None else None
        error = None if state != FAILED else (attempt.error or f"job {attempt.state}")
        self.registry.record_trial(Trial(self.sweep_id, trial.num, trial.params, state, step, value, error,
                                         time.time()))

    # -- telling the user ---------------------------------------------------------------------------

    def best_line(self) -> str:
        done = [t for t in self.registry.trials(self.sweep_id)
                if t.state == COMPLETED and t.value is not None]
        if not done:
            return "best: none yet"
        pick = min if self.settings.direction == "minimize" else max
        best = pick(done, key=lambda t: cast(float, t.value))
        return (f"best: trial {best.num}, {self.settings.objective}={best.value:.6g} "
                f"({' '.join(space.overrides(best.params, self.plan.fixed))})")

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)
