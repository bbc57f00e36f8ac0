"""The one order of a single job's submission (``orchestrator/launch/submission.py``), tested once
for every entry point that builds a ``Submission``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import run_lock, submission


def square(x: int) -> int:
    return x * x


class Steps:
    """Each step the submission takes, recorded by name; the real functions are called through,
    except the queue, the registry and the follow, which are answered here."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken: list[str] = []
        self._inside = False
        self._monkeypatch = monkeypatch
        self.through("check_dir", submission.ownership, "check")
        self.through("signal_delay", submission.signal_delay, "at_submission")
        self.through("claim", submission.ownership, "claim")
        self.through("lock", submission.run_lock, "check_free")
        self.through("provenance", submission.provenance, "at_submission")
        self.through("executor", submission.submit, "make_executor")
        self.through("dry_run", submission.submit, "dry_run_text")
        self.answer("queue", submission.submit, "submit", lambda *a, **k: "JOB")
        self.answer("record", submission.single, "record_submitted", lambda *a, **k: "ROW")
        self.answer("follow", submission.single, "follow", lambda *a, **k: ["RESULT"])

    def through(self, name: str, owner: Any, attribute: str) -> None:
        real = getattr(owner, attribute)

        def step(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # a step's own use of another (claim asks the run lock): not a step
                return real(*args, **kwargs)
            self.taken.append(name)
            self._inside = True
            try:
                return real(*args, **kwargs)
            finally:
                self._inside = False
        self._monkeypatch.setattr(owner, attribute, step)

    def answer(self, name: str, owner: Any, attribute: str, value: Callable[..., Any]) -> None:
        def step(*args: Any, **kwargs: Any) -> Any:
            self.taken.append(name)
            return value(*args, **kwargs)
        self._monkeypatch.setattr(owner, attribute, step)


def request(steps: Steps, run_dir: Path, **cluster: Any) -> submission.Submission[int]:
    def check(submitted_cluster: ClusterConfig) -> submission.Plan[int]:
        steps.taken.append("check")
        assert submitted_cluster.signal_delay_s is not None  # the checks see the cluster as queued
        return submission.Plan(square, (3,), "a: 1\n", dry_run_preface="the memory table",
                               before_submit=lambda: steps.taken.append("before_submit"))
    return submission.Submission(app="train", command="a=1", run_dir=run_dir,
                                 cluster=dataclasses.replace(ClusterConfig(), **cluster),
                                 parallelism=ParallelismConfig(), overrides=["a=1"], check=check,
                                 held=[(run_dir / "ckpt", "checkpoint.dir")], dir_checked=False)


def test_every_step_in_its_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    steps = Steps(monkeypatch)
    done = request(steps, tmp_path / "run").run()
    assert steps.taken == ["check_dir", "signal_delay", "claim", "lock", "check", "provenance", "executor",
                           "before_submit", "queue", "record", "follow"]
    assert (done.job, done.recorded, done.results) == ("JOB", "ROW", ["RESULT"])
    assert capsys.readouterr().out.startswith(f"run_dir: {tmp_path / 'run'}\n")  # first, always


def test_a_dry_run_stops_after_printing_the_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    steps = Steps(monkeypatch)
    done = request(steps, tmp_path / "run", mode="slurm", dry_run=True).run()
    assert steps.taken == ["check_dir", "signal_delay", "claim", "lock", "check", "provenance", "executor",
                           "dry_run"]
    assert done.job is None and done.results is None
    out = capsys.readouterr().out
    assert out.index("the memory table") < out.index("#SBATCH")  # the script stays the tail


def test_a_run_directory_in_use_is_refused_before_any_check(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    steps = Steps(monkeypatch)
    run_dir = tmp_path / "run"
    with run_lock.hold(run_dir, "job 41 (rank 0)"), pytest.raises(run_lock.RunDirInUseError,
                                                                  match="in use by job 41"):
        request(steps, run_dir).run()
    assert steps.taken == ["check_dir"]  # nothing written there, not even the signal delay's choice
    assert not (run_dir / submission.SUBMITIT_DIR).exists()


def test_a_plan_that_runs_here_skips_the_executor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps = Steps(monkeypatch)
    here = submission.Submission(
        app="run", command="", run_dir=tmp_path, cluster=dataclasses.replace(ClusterConfig(), mode="debug"),
        parallelism=ParallelismConfig(), overrides=[], dir_checked=False,
        check=lambda cluster: submission.Plan(square, (2,), "", in_process=lambda: [square(2)],
                                              before_submit=lambda: steps.taken.append("before_submit")))
    assert here.run().results == [4]
    assert steps.taken == ["check_dir", "signal_delay", "claim", "before_submit"]
