"""The submitter sees a short job start and end without waiting out a long poll: a fixed 5 s poll
of a pending job made every short job on an idle cluster take up to 5 s longer than it ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import submitit

from orchestrator.launch import slurm_request, submit


def test_a_job_that_starts_at_once_is_seen_running_within_a_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    states = iter(["PENDING", "PENDING", "RUNNING"])
    slept: list[float] = []
    monkeypatch.setattr(submit.StateWatch, "state", lambda self: next(states))
    monkeypatch.setattr(slurm_request, "pending_reason", lambda job_id: "Priority")
    monkeypatch.setattr(submit.time, "sleep", slept.append)
    submit.watch_pending(submitit.SlurmJob(tmp_path, "4242"), "cancel")
    assert len(slept) == 2 and sum(slept) < 1.0, slept


def test_a_long_pending_job_is_asked_about_at_most_every_poll_s() -> None:
    waits = submit.backoff(most_s=5.0)
    sequence = [next(waits) for _ in range(40)]
    assert sequence[0] <= 0.5 and max(sequence) == 5.0 and sequence == sorted(sequence)
