"""Real multi-process DDP through submitit's local executor: the no-cluster path. The ranks start
both ways a local job may start them (``cluster.rank_start``): forked from a controller that
imported once (``orchestrator.launch.fork_start``), and as new interpreters."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from jobs import smoke
from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import local_jobs, submit

STARTS = {"forked": ("jobs.smoke",), "started": ()}  # make_executor's rank_modules for each


@pytest.fixture(params=sorted(STARTS))
def rank_modules(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return STARTS[request.param]


def test_local_mode_runs_every_rank(tmp_path: Path,
        rank_modules: tuple[str, ...]) -> None:
    executor = submit.make_executor(ClusterConfig(mode="local"),
                                    ParallelismConfig(procs_per_node=3), tmp_path / "jobs",
                                    rank_modules=rank_modules)
    results = submit.results(submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv")))
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert all(r["reduced"] == 6.0 and r["backend"] == "gloo" for r in results)


def test_debug_mode_runs_in_process(tmp_path: Path) -> None:
    executor = submit.make_executor(ClusterConfig(mode="debug"), ParallelismConfig(), tmp_path)
    [result] = submit.results(submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv")))
    assert result["world_size"] == 1 and result["reduced"] == 1.0


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_local_failure_names_the_rank_and_stops_the_others_fast(tmp_path: Path, sigint: str,
        rank_modules: tuple[str, ...]) -> None:
    """Also when started with SIGINT ignored, as a shell's background job or CI runner is: then
    submitit's own cancel (a SIGINT to its controller) does nothing."""
    executor = submit.make_executor(ClusterConfig(mode="local"),
                                    ParallelismConfig(procs_per_node=2), tmp_path / "jobs",
                                    rank_modules=rank_modules)
    start = time.monotonic()
    disposition = signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, disposition)
    try:  # the job's processes inherit the disposition at submission
        job = submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv"), fail_on_rank=1,
                            rendezvous_timeout_s=300)
    finally:
        signal.signal(signal.SIGINT, previous)
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    # rank 0 would otherwise wait the whole 300 s rendezvous timeout for rank 1
    assert time.monotonic() - start < 120
    assert info.value.failed_ranks == [1]
    assert "rank 1 on node" in str(info.value)
    assert "deliberate failure on rank 1" in str(info.value)


def test_a_local_rank_killed_by_a_signal_is_named_and_the_others_stopped(tmp_path: Path,
        rank_modules: tuple[str, ...]) -> None:
    """SIGKILL (the OOM killer) leaves no result and raises nothing: the rank is seen gone."""
    executor = submit.make_executor(ClusterConfig(mode="local"),
                                    ParallelismConfig(procs_per_node=3), tmp_path / "jobs",
                                    rank_modules=rank_modules)
    start = time.monotonic()
    job = submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv"), kill_rank=2,
                        rendezvous_timeout_s=300)
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    # ranks 0 and 1 would otherwise wait the whole 300 s rendezvous timeout for rank 2
    assert time.monotonic() - start < 120
    assert info.value.failed_ranks == [2]
    message = str(info.value)
    assert "rank 2 on node" in message and "Switchyard saw the task ended without a result" in message
    assert "ranks [0, 1] were stopped after rank 2 failed" in message


def test_a_local_rank_that_dies_before_any_poll_sees_it_is_still_caught(tmp_path: Path,
        rank_modules: tuple[str, ...]) -> None:
    """Polling every 5 s, rank 2 (killed about a second after it starts) is usually gone before
    the first poll that finds its peers: it is then missing, not dead, and must count as dead."""
    executor = submit.make_executor(ClusterConfig(mode="local"),
                                    ParallelismConfig(procs_per_node=3), tmp_path / "jobs",
                                    rank_modules=rank_modules)
    start = time.monotonic()
    job = submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv"), kill_rank=2,
                        rendezvous_timeout_s=300)
    assert submit.wait_fail_fast(job, poll_s=5) == [(2, submit.LOCAL_DEATH)]
    assert time.monotonic() - start < 120


# A rank that prints, then dies as the OOM killer kills: exec is a builtin, so it pickles by name.
PRINT_THEN_DIE = ("import os, signal; print('step 7: loss 0.51', flush=True); "
                  "os.kill(os.getpid(), signal.SIGKILL)")


def test_a_killed_rank_shows_the_tail_of_its_stdout_too(tmp_path: Path,
        rank_modules: tuple[str, ...]) -> None:
    """Its last words were on stdout and the report read stderr alone: "(empty)"."""
    executor = submit.make_executor(ClusterConfig(mode="local"),
                                    ParallelismConfig(procs_per_node=1), tmp_path / "jobs",
                                    rank_modules=rank_modules)
    job = submit.submit(executor, exec, PRINT_THEN_DIE)
    with pytest.raises(submit.JobFailedError) as info:
        submit.results(job)
    message = str(info.value)
    assert "step 7: loss 0.51" in message and "_log.out:" in message, message
    assert "(empty)" not in message


# Both ranks wait until the fail-fast wait has found them; then rank 1 dies as the OOM killer kills
# and rank 0 returns at once, so the whole job ends long before the wait's next poll.
DIE_ONCE_FOUND = """
import os, pathlib, signal, time
def die_once_found(folder):
    while not (pathlib.Path(folder) / "found").exists():
        time.sleep(0.02)
    if os.environ["SUBMITIT_LOCAL_LOCALID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"
"""


def test_a_rank_killed_just_before_the_job_ends_is_named_though_no_poll_saw_it(
        tmp_path: Path, rank_modules: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in a full run: rank 1 killed mid-run, rank 0 failing at once on the lost connection, the
    controller ending with them, all between two polls: the report blamed rank 0's error and called
    rank 1 "stopped". A rank seen at work that left no result died, whenever the wait learns it."""
    (tmp_path / "die_once_found.py").write_text(DIE_ONCE_FOUND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))  # for the controller, ranks
    found_ranks = local_jobs.ranks

    def found_then_say_so(pid: int, folder: Path | None = None) -> dict[int, psutil.Process]:
        found = found_ranks(pid, folder)
        if len(found) == 2:
            (tmp_path / "found").touch()
        return found

    monkeypatch.setattr(local_jobs, "ranks", found_then_say_so)
    import die_once_found

    executor = submit.make_executor(ClusterConfig(mode="local"), ParallelismConfig(procs_per_node=2),
                                    tmp_path / "jobs", rank_modules=(*rank_modules, "die_once_found")
                                    if rank_modules else ())
    job = submit.submit(executor, die_once_found.die_once_found, str(tmp_path))
    assert submit.wait_fail_fast(job, poll_s=5.0) == [(1, submit.LOCAL_DEATH)]
