"""Which rank caused a failure, from per-rank outcomes and srun's task reports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.launch.submit import RankOutcome, culprits_of

LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"


def ranks(outcomes: list[RankOutcome]) -> list[int]:
    return [o.rank for o in outcomes]


def test_a_killed_rank_is_the_cause_not_the_peers_that_lost_it() -> None:
    outcomes = [RankOutcome(0, error=LOST), RankOutcome(1, error=LOST), RankOutcome(2, no_output="none"),
                RankOutcome(3, error=LOST)]
    died = [(2, "killed"), (0, "exited with exit code 1"), (1, "exited with exit code 1")]
    assert ranks(culprits_of(outcomes, died)) == [2]


def test_a_rank_that_raised_its_own_error_is_the_cause() -> None:
    outcomes = [RankOutcome(0, no_output="x"), RankOutcome(1, error="ValueError: bad batch"),
                RankOutcome(2, error=LOST)]
    assert ranks(culprits_of(outcomes, [(1, "exited with exit code 1")])) == [1]


def test_only_lost_peer_errors_falls_back_to_srun_order() -> None:
    outcomes = [RankOutcome(0, error=LOST), RankOutcome(1, error=LOST)]
    died = [(1, "exited with exit code 1"), (0, "exited with exit code 1")]
    assert ranks(culprits_of(outcomes, died)) == [1]


def test_nothing_known_names_the_ranks_without_output() -> None:
    outcomes = [RankOutcome(0, result=1), RankOutcome(1, no_output="killed by the scheduler")]
    assert ranks(culprits_of(outcomes, [])) == [1]


def test_srun_report_glued_to_a_progress_bar_is_found(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from orchestrator.launch.submit import srun_task_failures

    log = tmp_path / "9_0_log.err"
    log.write_text("train:   0%|  | 5/100 [00:00<?, loss=0.07]srun: error: n2: task 2: Killed\n"
                   "srun: error: n1: task 1: Terminated\n"
                   "srun: error: n1: tasks 0,3-4: Exited with exit code 1\n")
    job = SimpleNamespace(_sub_jobs=[SimpleNamespace(paths=SimpleNamespace(stderr=log))])
    assert srun_task_failures(job) == [(2, "killed"), (0, "exited with exit code 1"),  # type: ignore[arg-type]
                                       (3, "exited with exit code 1"), (4, "exited with exit code 1")]
    log.write_text("srun: error: n2: task 2: Killed\n"
                   "srun: launch/slurm: _step_signal: Terminating StepId=9.0\n"
                   "srun: error: n1: task 1: Terminated\nsrun: error: n2: task 3: Killed\n")
    assert srun_task_failures(job) == [(2, "killed")]  # type: ignore[arg-type]


def test_a_rank_failed_message_is_quoted_without_the_traceback_around_it() -> None:
    from orchestrator.launch.submit import quoted

    error = ("Job (task=2) failed during processing with trace:\n----------------------\n"
             "Traceback (most recent call last):\n  File \"submit.py\", line 148, in __call__\n"
             "    return self.fn(*args, **kwargs)\n"
             "orchestrator.launch.submit.RankFailed: rank 2 on node n2: `python x.py` exited with status 3\n"
             "its stdout ends:\n    the last line\n\n----------------------\n"
             "You can check full logs with 'job.stderr(2)'")
    assert quoted(error) == ("rank 2 on node n2: `python x.py` exited with status 3\n"
                             "its stdout ends:\n    the last line\n")
    assert quoted("ValueError: plain") == "ValueError: plain"


# Two ranks that fail deep in a call chain: each frame of 3.11's traceback is three lines, the
# last of them carets under the failing expression, so a 25-line tail begins with one.
# Each waits until both are there, so that both fail: one that fails alone has its peer stopped.
DEEP_FAILURE = """
import os, pathlib, time

def down(n):
    return 1 + across(n - 1)

def across(n):
    return 1 + down(n - 1) if n > 0 else fail()

def fail():
    raise ValueError(f"bad batch on rank {os.environ['SUBMITIT_LOCAL_LOCALID']}")

def deep_failure(folder):
    (pathlib.Path(folder) / os.environ["SUBMITIT_LOCAL_LOCALID"]).touch()
    while len(list(pathlib.Path(folder).iterdir())) < 2:
        time.sleep(0.01)
    return down(12)
"""


def test_each_failed_rank_is_named_with_its_exception_not_the_carets_of_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ranks failed: each rank's line read ``rank 0 on node n1: ^^^^^^^^^^`` (the first
    line of its traceback's tail), the error itself 24 lines below."""
    import os

    from orchestrator.config import ClusterConfig, ParallelismConfig
    from orchestrator.launch import submit

    (tmp_path / "deep_failure.py").write_text(DEEP_FAILURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))  # for the controller, ranks
    import deep_failure

    executor = submit.make_executor(ClusterConfig(mode="local"), ParallelismConfig(procs_per_node=2),
                                    tmp_path / "jobs")
    (tmp_path / "ready").mkdir()
    job = submit.submit(executor, deep_failure.deep_failure, str(tmp_path / "ready"))
    with pytest.raises(submit.JobFailedError) as failed:
        submit.results(job)
    report = str(failed.value)
    heads = [line for line in report.splitlines() if line.startswith("rank ")]
    assert [re.sub(r" on node [^:\s]+", "", line) for line in heads] == [
        "rank 0: ValueError: bad batch on rank 0", "rank 1: ValueError: bad batch on rank 1"], report
    assert "^^^" in report  # the traceback's tail is still quoted, under its exception


@pytest.mark.parametrize(("text", "line"), [
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    y = g(1) + 2\n"
     "        ^^^^\nValueError: bad\n\n----------------------\nYou can check full logs with 'job.stderr(0)'",
     "ValueError: bad"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    d['k']\n    ~^^^^^\n"
     "KeyError: 'k'\n\nDuring handling of the above exception, another exception occurred:\n\n"
     "Traceback (most recent call last):\n  File \"x.py\", line 5, in f\n"
     "    raise RuntimeError('lost') from None\n"
     "torch.distributed.DistBackendError: lost\n", "torch.distributed.DistBackendError: lost"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    raise KeyboardInterrupt\n"
     "KeyboardInterrupt\n", "KeyboardInterrupt"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    assert x\n           ^\n"
     "AssertionError\n   \n", "AssertionError"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    raise MyError()\nmod.MyError:\n",
     "mod.MyError:"),
    ("step 7: loss 0.51\n   ^^^^\n", None),
], ids=["carets-and-footer", "chained", "bare-name", "no-message-blank-after", "empty-message", "none"])
def test_the_exception_line_of_a_traceback_is_found(text: str, line: str | None) -> None:
    from orchestrator.launch.submit import exception_line

    assert exception_line(text) == line
