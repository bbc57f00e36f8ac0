"""Searches with real local jobs (``cluster=local``): each trial a ``jobs.train`` job training
``search_helpers.Quadratic``, whose best learning rate is known (0.25; the helper's docstring says
why). The controller runs in the test's process; the kill-and-resume test runs it as the user
does, ``python -m jobs.train -m hydra/sweeper=switchyard_optuna``, and kills that process."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from search_helpers import OPTIMUM_LR
from train_helpers import CHEAP

from orchestrator.config import ConfigError
from orchestrator.registry.db import Registry
from orchestrator.search import controller, study
from orchestrator.search.settings import SearchSettings

ROOT = Path(__file__).resolve().parents[3]
QUADRATIC = ["model=custom", "model._target_=search_helpers.Scalar", "task=custom",
             "task._target_=search_helpers.Quadratic", "optim=sgd", "optim.momentum=0",
             "parallelism.procs_per_node=1", *CHEAP]


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    path = tmp_path / "registry.db"
    monkeypatch.setenv("SWITCHYARD_REGISTRY", str(path))
    # the trials' ranks import search_helpers by its _target_, as a user's ranks import their package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                      os.environ.get("PYTHONPATH", "")]))
    return Registry(path)


def search(registry: Registry, sweep_dir: Path, base: list[str], **settings: object) -> tuple[int, str]:
    out = io.StringIO()
    plan = controller.check(SearchSettings(**settings), [*QUADRATIC, *base], "jobs.train")  # type: ignore[arg-type]
    sweep_id = controller.start(plan, registry, sweep_dir, "train", " ".join(base), out)
    return sweep_id, out.getvalue()


def test_a_search_finds_the_known_optimum_and_starts_each_trial_as_another_ends(
        registry: Registry, tmp_path: Path) -> None:
    """12 trials, 3 at once, lr log-uniform over 1e-3..1 (3 decades; the target, 0.125..0.5, is 0.6
    of one): the best is within 2x of 0.25."""
    # trials of unequal length (+model.spread), as real ones are: with equal ones, three trials
    # started together end together, and any controller refills the three slots at once
    base = ["optim.max_steps=60", "eval_every_steps=20", "+model.delay_s=0.05", "+model.spread=true",
            f"data.cache_dir={tmp_path / 'data'}"]
    sweep_id, out = search(registry, tmp_path / "sweep", base, n_trials=12, n_jobs=3, seed=1, poll_s=0.5,
                           params={"optim.lr": "tag(log, interval(1e-3, 1))"})
    trials = registry.trials(sweep_id)
    assert len(trials) == 12 and all(t.state == "COMPLETED" for t in trials), out
    best = min(trials, key=lambda t: t.value or 0.0)
    assert OPTIMUM_LR / 2 <= best.params["optim.lr"] <= OPTIMUM_LR * 2, out
    # No trial waited for a batch: each one from the 4th on was submitted while others still ran
    # (in batches of 3, the first trial of each batch waits for all three before it to end), and
    # never more than 3 ran at once.
    attempts = [registry.attempts(sweep_id, t.num)[0] for t in trials]
    assert all(len(registry.attempts(sweep_id, t.num)) == 1 for t in trials)
    for later in attempts[3:]:
        running = [a for a in attempts if a.submitted_at < later.submitted_at
                   and (a.ended_at or 0) > later.submitted_at]
        assert 0 < len(running) < 3, (later.num, [(a.num, a.submitted_at, a.ended_at) for a in attempts])
    assert f"best: trial {best.num}" in out.splitlines()[-1]


def test_a_trial_that_diverges_to_nan_is_recorded_failed_and_the_search_goes_on(
        registry: Registry, tmp_path: Path) -> None:
    """lr >= 5 multiplies w by 19 or more each step: w^2 overflows float32 within 60 steps."""
    sweep_id, out = search(registry, tmp_path / "sweep", ["optim.max_steps=60", "eval_every_steps=20",
                                                          f"data.cache_dir={tmp_path / 'data'}"],
                           n_trials=2, n_jobs=1, poll_s=0.3, params={"optim.lr": "interval(5.0, 9.9)"})
    trials = registry.trials(sweep_id)
    assert [t.state for t in trials] == ["FAILED", "FAILED"], out  # the second asked after the first failed
    for trial in trials:
        assert "nan" in (trial.error or "").lower() or "inf" in (trial.error or "").lower(), trial.error
        assert f"trial {trial.num} FAILED: " in out
    assert out.splitlines()[-1] == "best: none yet"


def test_an_objective_no_trial_writes_stops_the_search_at_the_first_trial_naming_the_key(
        registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(controller.SearchError, match=r"^hydra\.sweeper\.objective='eval_los': trial 0 "
                                                     r"completed without writing it"):
        search(registry, tmp_path / "sweep", ["optim.max_steps=4", f"data.cache_dir={tmp_path / 'data'}"],
               n_trials=5, n_jobs=1, poll_s=0.3, objective="eval_los",
               params={"optim.lr": "interval(0.1, 0.2)"})
    (sweep,) = registry.sweeps()
    assert [(t.num, t.state) for t in registry.trials(sweep.id)] == [(0, "FAILED")]  # not 5 trials' budget


def test_asha_prunes_bad_learning_rates_before_their_last_step_keeping_checkpoints(
        registry: Registry, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    base = ["optim.max_steps=40", "eval_every_steps=4", "+model.delay_s=0.05",
            f"data.cache_dir={tmp_path / 'data'}"]
    sweep_id, out = search(registry, sweep_dir, base,
                           n_trials=6, n_jobs=2, seed=3, pruner="asha", poll_s=0.3,
                           params={"optim.lr": "tag(log, interval(1e-4, 0.3))"})
    trials = registry.trials(sweep_id)
    pruned = [t for t in trials if t.state == "PRUNED"]
    completed = [t for t in trials if t.state == "COMPLETED"]
    assert pruned and completed and len(pruned) + len(completed) == 6, out
    best = min(completed, key=lambda t: t.value or 0.0)
    saved_s = 0.0
    for trial in pruned:
        assert trial.step is not None and trial.step < 40, out
        assert (trial.value or 0.0) > (best.value or 0.0), out  # stopped while behind the best
        attempt = registry.latest_attempts(sweep_id)[trial.num]
        assert attempt.state == "PRUNED" and f"at step {trial.step}" in (attempt.error or ""), attempt
        assert list((sweep_dir / str(trial.num) / "checkpoints").glob("step-*.pt")), trial.num
        saved_s += (40 - trial.step) * 0.05
    print(f"ASHA pruned {len(pruned)} of 6 trials, saving about {saved_s:.1f} CPU-seconds of training")


def test_bad_input_is_refused_before_anything_is_submitted(registry: Registry, tmp_path: Path) -> None:
    cache = f"data.cache_dir={tmp_path / 'data'}"
    cases = [({"params": {"optim.lrr": "interval(0.1, 1)"}}, [],
              "hydra.sweeper.params.optim.lrr='interval(0.1, 1)': Could not override 'optim.lrr'"),
             ({"params": {"optim.lr": "interval(1, 0.1)"}}, [], "is an empty range"),
             ({"params": {"optim.lr": "tag(log, interval(0, 1))"}}, [], "is a log range reaching 0"),
             ({"params": {"optim.lr": "interval(0.1, 1)"}, "pruner": "asha"}, ["eval_every_steps=0"],
              "hydra.sweeper.pruner='asha' has no intermediate values")]
    for settings, base, says in cases:
        with pytest.raises(ConfigError, match=r"^[^\n]*$") as e:
            controller.check(SearchSettings(**settings), [*QUADRATIC, *base, cache], "jobs.train")  # type: ignore[arg-type]
        assert says in str(e.value), str(e.value)
    assert registry.sweeps() == []


def test_a_killed_controller_resumes_adopting_its_running_trials(registry: Registry, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    command = [sys.executable, "-m", "jobs.train", "-m", "hydra/sweeper=switchyard_optuna",
               "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2", "hydra.sweeper.poll_s=0.3",
               "hydra.sweeper.seed=0", "optim.lr=tag(log, interval(1e-2, 0.4))", *QUADRATIC,
               "optim.max_steps=40", "eval_every_steps=10", "+model.delay_s=0.05",
               f"data.cache_dir={tmp_path / 'data'}", f"hydra.sweep.dir={sweep_dir}"]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        running = wait_for_running_trials(registry, first)
    finally:
        first.send_signal(signal.SIGKILL)  # mid-search: trials running, others still to ask
        output = first.communicate()[0]
    sweep_id = registry.sweeps()[-1].id
    before = {num: registry.attempts(sweep_id, num)[0].slurm_id for num in running}
    resumed = subprocess.run([sys.executable, "-m", "orchestrator.cli", "search", "resume", str(sweep_id)],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "running (adopted, not resubmitted)" in resumed.stdout
    trials = registry.trials(sweep_id)
    assert [t.num for t in trials] == list(range(6)), output + resumed.stdout
    assert all(t.state == "COMPLETED" for t in trials), resumed.stdout
    # no trial ran twice: one attempt each, the adopted ones the jobs started before the kill
    for t in trials:
        assert len(registry.attempts(sweep_id, t.num)) == 1
    assert {num: registry.attempts(sweep_id, num)[0].slurm_id for num in running} == before
    frozen = study.open_study(sweep_dir, SearchSettings(), 10, 40).get_trials()
    assert len(frozen) == 6 and all(t.state == optuna.trial.TrialState.COMPLETE for t in frozen)


def wait_for_running_trials(registry: Registry, process: subprocess.Popen[str], timeout_s: float = 300
                            ) -> list[int]:
    """The trials running once at least one has started and written an eval window, with trials
    still to ask: the moment to kill the controller."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the search ended before it could be killed"
        sweeps = registry.sweeps()
        if sweeps:
            trials = registry.trials(sweeps[-1].id)
            running = [t.num for t in trials if t.state == "RUNNING"]
            started = [n for n in running
                       if (Path(sweeps[-1].sweep_dir) / str(n) / "metrics.jsonl").exists()]
            if started and len(trials) < 6:
                return running
        time.sleep(0.2)
    raise AssertionError("no trial started in time")


def test_the_sweeper_refuses_bad_input_in_one_line_and_submits_nothing(registry: Registry, tmp_path: Path
                                                                      ) -> None:
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "-m", "hydra/sweeper=switchyard_optuna",
                           "hydra.sweeper.pruner=asha", "optim.lr=tag(log, interval(0, 1e-1))", *QUADRATIC,
                           f"data.cache_dir={tmp_path / 'data'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: hydra.sweeper.params.optim.lr='tag(log, interval(0, 1e-1))' is a log range reaching 0: "
        "a log range's start must be > 0 (e.g. tag(log, interval(1e-6, 0.1)))"], proc.stderr
    assert registry.sweeps() == [] and not (tmp_path / "sweep").exists()
