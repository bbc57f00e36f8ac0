"""How a rank's end is told: the signal by name, the OOM killer only where the kernel counted a
kill in the rank's memory cgroup (files as cgroup v1 and v2 write them)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from orchestrator.scripts.rank import (
    RankEnd,
    StopRequest,
    exit_status,
    first_failed,
    how_it_ended,
    oom_kills,
)


def test_the_oom_kill_count_is_read_from_a_v2_or_a_v1_memory_cgroup(tmp_path: Path) -> None:
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "step" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    (tmp_path / "v2").write_text("0::/job/step\n")
    assert oom_kills(tmp_path / "v2", tmp_path) == 1
    (tmp_path / "memory" / "slurm").mkdir(parents=True)
    (tmp_path / "memory" / "slurm" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (tmp_path / "v1").write_text("4:memory:/slurm\n1:cpu:/\n0::/\n")
    assert oom_kills(tmp_path / "v1", tmp_path) == 2
    (tmp_path / "none").write_text("0::/elsewhere\n")
    assert oom_kills(tmp_path / "none", tmp_path) is None  # the kernel does not say: never guessed
    assert oom_kills(tmp_path / "missing", tmp_path) is None


def test_a_signal_is_named_and_the_oom_killer_only_on_the_kernels_word() -> None:
    assert how_it_ended(3) == "exited with status 3"
    assert how_it_ended(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert how_it_ended(-signal.SIGKILL) == "was killed by SIGKILL (kill -9, or the OOM killer)"
    assert how_it_ended(-signal.SIGKILL, oom_killed=True).startswith("was killed by SIGKILL (the OOM killer")
    assert how_it_ended(-signal.SIGKILL, oom_killed=False).startswith("was killed by SIGKILL (not the OOM")
    assert [exit_status(c) for c in (0, 3, -signal.SIGKILL, None)] == [0, 3, 137, 1]


def test_the_jobs_end_is_the_first_rank_that_failed_of_its_own() -> None:
    ends = {0: RankEnd(0, "n1", 0, 10.0), 1: RankEnd(1, "n1", 3, 14.0), 2: RankEnd(2, "n2", 1, 15.0),
            3: RankEnd(3, "n2", -signal.SIGTERM, 12.0, stopped=True)}
    failed = first_failed(ends)
    assert failed is not None and failed.rank == 1
    assert first_failed({0: ends[0], 3: ends[3]}) is None  # stopped on request: not a failure


def test_a_signal_after_the_command_ended_does_not_make_it_stopped() -> None:
    """SIGTERM while rank 0 waits for the other ranks' ends, its own command having exited 0: the
    command finished, it was not stopped (a cancel at the very end must not relabel a done rank)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        before = StopRequest(forward=False).install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert before.preempted  # while the command runs, SIGTERM is preemption or a cancel
        after = StopRequest(forward=False).install()
        after.command_ended()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert not after.preempted and not after.time_limit
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
