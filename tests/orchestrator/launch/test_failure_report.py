"""Which rank caused a failure, from per-rank outcomes and srun's task reports."""

from __future__ import annotations

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
