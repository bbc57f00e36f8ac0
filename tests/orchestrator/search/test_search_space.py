"""The search's pure parts: Hydra's sweep grammar to Optuna distributions and its refusals, the
settings' checks, the trial rows and the PRUNED state in the registry, metrics.jsonl as it grows."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution

from orchestrator.config import ConfigError
from orchestrator.registry.db import Registry, Trial
from orchestrator.registry.states import accepts
from orchestrator.search import metrics, space
from orchestrator.search.settings import SearchSettings


def test_hydra_sweep_grammar_becomes_optuna_distributions() -> None:
    searched, fixed = space.parse({"optim.lr": "tag(log, interval(1e-5, 1e-1))",
                                   "data.batch_size": "choice(16, 32)", "model.depth": "range(1, 4)",
                                   "model.width": "interval(8, 64)", "seed": "3"})
    assert searched["optim.lr"] == FloatDistribution(1e-5, 1e-1, log=True)
    assert searched["data.batch_size"] == CategoricalDistribution([16, 32])
    assert searched["model.depth"] == CategoricalDistribution([1, 2, 3])  # stop excluded, as Hydra sweeps it
    assert searched["model.width"] == FloatDistribution(8.0, 64.0)  # Hydra reads interval's bounds as floats
    assert fixed == {"seed": 3}
    assert space.overrides({"optim.lr": 0.001, "data.batch_size": 16}, fixed) == \
        ["seed=3", "optim.lr=0.001", "data.batch_size=16"]


@pytest.mark.parametrize(("text", "says"), [
    ("interval(0.1, 0.01)", "hydra.sweeper.params.optim.lr='interval(0.1, 0.01)' is an empty range"),
    ("interval(0.1, 0.1)", "is an empty range"),
    ("range(5, 1)", "hydra.sweeper.params.optim.lr='range(5, 1)' is an empty range"),
    ("tag(log, interval(0, 1))", "is a log range reaching 0"),
    ("tag(log, interval(-1, 1))", "is a log range reaching 0"),
    ("interval(1, ", "cannot be parsed"),
])
def test_a_bad_range_is_refused_naming_the_key(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.params\.optim\.lr=") as e:
        space.parse({"optim.lr": text})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_space_with_nothing_to_search_is_refused() -> None:
    with pytest.raises(ConfigError, match="searches nothing"):
        space.parse({"optim.lr": "0.1"})


@pytest.mark.parametrize(("key", "value"), [("pruner", "asha2"), ("direction", "down"), ("sampler", "grid"),
                                            ("n_jobs", 0), ("n_trials", 0)])
def test_settings_are_checked_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^hydra.sweeper.{key}={value!r} is invalid"):
        SearchSettings(**{key: value})  # type: ignore[arg-type]


def test_pruned_stays_pruned_as_cancelled_stays_cancelled() -> None:
    assert accepts("RUNNING", 0, "PRUNED", 0)
    assert not accepts("PRUNED", 0, "CANCELLED", 0)  # sacct's view of the cancel that pruned it
    assert not accepts("PRUNED", 0, "COMPLETED", 0)  # its ranks exiting 0 after the SIGTERM
    assert not accepts("PRUNED", 0, "FAILED", 0)


def test_trials_are_kept_in_the_registry(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.db") as registry:
        sweep = registry.create_sweep("train", "", str(tmp_path), "local", "")
        recorded = {"settings": {}, "base": [], "app": "x"}
        registry.record_search(sweep, str(tmp_path / "study.journal"), recorded)
        registry.record_trial(Trial(sweep, 0, {"optim.lr": 0.1}, "RUNNING", None, None, None, 0.0))
        registry.record_trial(Trial(sweep, 0, {"optim.lr": 0.1}, "PRUNED", 8, 1.5, None, 0.0))
        assert [(t.num, t.state, t.step, t.value) for t in registry.trials(sweep)] == [(0, "PRUNED", 8, 1.5)]
        assert registry.search(sweep) == (str(tmp_path / "study.journal"), recorded)
        assert registry.search(sweep + 1) is None


def test_metrics_windows_skip_the_line_being_written_and_read_null_as_nan(tmp_path: Path) -> None:
    lines = [{"step": 5, "loss": 1.0}, {"step": 5, "eval_loss": 0.5}, {"step": 10, "eval_loss": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 15, "ev')
    found = metrics.windows(tmp_path, "eval_loss")
    assert [w.step for w in found] == [5, 10] and found[0].value == 0.5 and math.isnan(found[1].value)
    assert metrics.windows(tmp_path / "missing", "eval_loss") == []


def test_resubmit_refuses_a_search_naming_its_resume(tmp_path: Path) -> None:
    from orchestrator.sweeps import status

    with Registry(tmp_path / "r.db") as registry:
        sweep = registry.create_sweep("train", "", str(tmp_path), "local", "")
        registry.record_search(sweep, str(tmp_path / "j"), {"settings": {}, "base": [], "app": "x"})
        with pytest.raises(status.CommandError, match=f"switchyard search resume {sweep}"):
            status.cmd_resubmit(registry, str(sweep), failed=True, as_json=False)


def test_the_sweeps_list_counts_pruned_trials_as_stopped_not_active() -> None:
    from orchestrator.sweeps import status

    summary = {"id": 1, "created_at": 0.0, "app": "train", "executor": "local", "jobs": 3, "command": "",
               "states": {"COMPLETED": 1, "PRUNED": 2}}
    row = status.sweeps_table([summary], colour=False).splitlines()[1].split()
    assert row[5:9] == ["1", "0", "0", "2"]  # DONE ACTIVE FAILED CANCELLED


def recorded_search(registry: Registry, tmp_path: Path) -> int:
    """A search of three trials as the controller leaves them: completed, pruned, failed."""
    from orchestrator.registry.db import Job

    settings = SearchSettings(n_trials=3, params={"optim.lr": "tag(log, interval(1e-4, 1))"}).as_dict()
    sweep = registry.create_sweep("train", "", str(tmp_path), "local", "")
    registry.record_search(sweep, str(tmp_path / "j"), {"settings": settings, "base": ["optim=sgd"],
                                                        "app": "jobs.train"})
    registry.add_jobs([Job(sweep, n, [f"optim.lr={lr}"], str(tmp_path / str(n)), {}, 40)
                       for n, lr in enumerate((0.2, 0.001, 9.0))])
    registry.claim(sweep, [0, 1, 2])
    registry.record_trial(Trial(sweep, 0, {"optim.lr": 0.2}, "COMPLETED", 40, 1e-9, None, 0.0))
    registry.record_trial(Trial(sweep, 1, {"optim.lr": 0.001}, "PRUNED", 8, 1.9, None, 0.0))
    registry.record_trial(Trial(sweep, 2, {"optim.lr": 9.0}, "FAILED", None, None,
                                "eval_loss is NaN at step 4", 0.0))
    return sweep


def test_status_shows_each_trial_and_the_best_so_far(tmp_path: Path) -> None:
    from orchestrator.search import view

    with Registry(tmp_path / "r.db") as registry:
        sweep = recorded_search(registry, tmp_path)
        out = io.StringIO()
        view.cmd_status(registry, sweep, as_json=False, out=out)
        lines = out.getvalue().splitlines()
        assert lines[-5].split() == ["TRIAL", "STATE", "EVAL_LOSS", "optim.lr", "CAUSE"]
        assert lines[-3].split()[:5] == ["1", "PRUNED", "at", "step", "8"]
        assert "eval_loss is NaN at step 4" in lines[-2]
        assert lines[-1] == "3 of 3 trials ended; best so far: trial 0, eval_loss=1e-09 (optim.lr=0.2)"
        out = io.StringIO()
        view.cmd_status(registry, sweep, as_json=True, out=out)
        shown = json.loads(out.getvalue())["search"]
        assert shown["best"] == 0
        assert [(t["state"], t["step"]) for t in shown["trials"]] == [("COMPLETED", 40), ("PRUNED", 8),
                                                                      ("FAILED", None)]
        assert {"started_at", "ended_at", "submitted_at", "params", "value"} <= set(shown["trials"][0])


def test_best_prints_overrides_ready_to_paste_and_the_run_dir(tmp_path: Path) -> None:
    from orchestrator.search import view

    with Registry(tmp_path / "r.db") as registry:
        sweep = recorded_search(registry, tmp_path)
        out = io.StringIO()
        view.cmd_best(registry, sweep, as_json=False, out=out)
        expected = ["trial 0: eval_loss=1e-09", "overrides: optim=sgd optim.lr=0.2",
                    f"run_dir: {tmp_path / '0'}"]
        assert out.getvalue().splitlines() == expected


def test_hydra_scanning_the_sweeper_plugin_does_not_import_optuna() -> None:
    """Hydra imports every plugin module at each app's start: a run that does not search must not
    pay for Optuna's import."""
    import subprocess
    import sys

    code = "import sys, hydra_plugins.switchyard_optuna.sweeper; print('optuna' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_a_second_controller_of_the_same_search_is_refused(tmp_path: Path) -> None:
    from orchestrator.search import controller

    refused = pytest.raises(controller.SearchError, match=r"another controller is running this search \(pid")
    with controller.held(tmp_path), refused, controller.held(tmp_path):
        pass
    with controller.held(tmp_path):  # released when its holder let go (or died)
        pass
