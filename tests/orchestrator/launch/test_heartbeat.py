"""Which rank hung: the heartbeat verdict on its own, and end to end on a real local job whose rank 1
is frozen with SIGSTOP mid-training (the waiting rank times out in its collective)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from train_helpers import CHEAP, run_train, train_command

from orchestrator.launch import local_jobs
from orchestrator.launch.heartbeat import Beat, Heartbeat, read_beats, verdict

TESTS = str(Path(__file__).resolve().parents[2])  # model_helpers, for the ranks


def beat(rank: int, at: float, step: int = 10, phase: str = "compute") -> Beat:
    return Beat(rank=rank, node="n1", pid=100 + rank, beat=5, time=at, step=step, phase=phase,
                interval_s=1.0)


def test_a_rank_whose_beats_stopped_long_before_the_others_is_named() -> None:
    found = verdict([beat(0, 100.0), beat(1, 80.0), beat(2, 99.5), beat(3, 100.2)], 4)
    assert found.ranks == [1]
    assert "stopped answering" in found.why[1] and "pid 101 on node n1" in found.why[1]


def test_a_skew_under_the_interval_blames_nobody_for_freezing() -> None:
    found = verdict([beat(0, 100.0), beat(1, 99.2), beat(2, 100.4)], 3)
    assert found.ranks == [] and "cannot tell which rank hung" in found.summary


def test_a_rank_alive_but_behind_in_its_step_is_the_one_waited_for() -> None:
    found = verdict([beat(0, 100.0, 12, "compute"), beat(1, 100.0, 12, "data"),
                     beat(2, 100.0, 12, "compute")], 3)
    assert found.ranks == [1] and "fell behind" in found.why[1]


def test_a_rank_that_never_beat_is_named() -> None:
    assert verdict([beat(0, 100.0), beat(2, 100.0)], 3).ranks == [1]


def test_heartbeat_writes_its_progress_and_advances(tmp_path: Path) -> None:
    with Heartbeat(tmp_path, 3, "n2", interval_s=0.05) as pulse:
        pulse.mark(7, "eval")
        time.sleep(0.3)
    [last] = read_beats(tmp_path)
    assert (last.rank, last.node, last.step, last.phase, last.pid) == (3, "n2", 7, "eval", os.getpid())
    assert last.beat >= 3


def test_a_frozen_rank_is_named_and_the_failure_reads_as_a_failure(tmp_path: Path) -> None:
    """Before: 'job N failed (INTERRUPTED)', rank 0 blamed for rank 1's hang, and a
    KeyboardInterrupt traceback from submitit's controller on the user's terminal."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        train_command("optim.max_steps=1000000", "data.demo_num_samples=512", "data.batch_size=16",
                      "telemetry.enabled=false", "cluster.collective_timeout_s=6",
                      cache_dir=tmp_path / "cache", run_dir=run_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frozen = _pid_once_training(run_dir / "heartbeat" / "rank-1.json", proc)
        os.kill(frozen, signal.SIGSTOP)
        _out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
        for log in (run_dir / "submitit").glob("*_0_log.out"):  # ranks outlive a killed submitter
            local_jobs.kill(int(log.name.split("_")[0]))
    assert proc.returncode == 2, err[-3000:]
    report = err[err.index("error: job"):]
    assert "failed (FAILED)" in report.splitlines()[0]
    assert "rank 1 stopped answering" in report
    culprit = next(line for line in report.splitlines() if line.startswith("rank "))
    assert culprit.startswith("rank 1 ") and f"pid {frozen}" in culprit, report
    assert "ranks [0] were stopped after rank 1" in report
    assert "KeyboardInterrupt" not in err and "INTERRUPTED" not in err


def test_a_rank_late_to_its_first_step_is_not_a_hang(tmp_path: Path) -> None:
    """Before: one collective timeout for the whole run, so a timeout short enough to name a hang
    quickly failed a healthy start whose ranks reached DDP's first broadcast apart (imports on a
    shared file system, a checkpoint's load). Until the first step ends they wait
    ``cluster.init_timeout_s``; after it, a frozen rank is still named within the short timeout
    (the test above)."""
    run = run_train("optim.max_steps=3", "data.demo_num_samples=512", "data.batch_size=16", *CHEAP,
                    "cluster.collective_timeout_s=2", "model=custom",
                    "model._target_=model_helpers.SlowToBuildOnRank1", cache_dir=tmp_path / "cache",
                    run_dir=tmp_path / "run", timeout=300,
                    env={"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def _pid_once_training(path: Path, proc: subprocess.Popen[str]) -> int:
    """Rank 1's pid once its heartbeat shows it past a few steps."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            record = json.loads(path.read_text())
            if record["step"] >= 3:
                return int(record["pid"])
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"rank 1 never reported training (exit {proc.poll()})")


def test_a_rank_that_paused_then_woke_is_still_named() -> None:
    """SLURM sends SIGCONT before terminating a step: the frozen rank beats once more before dying."""
    woke = Beat(rank=1, node="n1", pid=101, beat=6, time=100.5, step=10, phase="compute",
                interval_s=1.0, longest_pause_s=9.0)
    found = verdict([beat(0, 100.0), woke, beat(2, 100.1)], 3)
    assert found.ranks == [1] and "paused for 9 s" in found.why[1]


def test_heartbeat_measures_its_longest_pause(tmp_path: Path) -> None:
    pulse = Heartbeat(tmp_path, 0, "n1", interval_s=10.0)
    pulse.path.parent.mkdir(parents=True)
    pulse.beat()
    time.sleep(0.3)  # as if the process had been stopped between two beats
    pulse.beat()
    [last] = read_beats(tmp_path)
    assert last.longest_pause_s >= 0.3


def test_ranks_that_gave_up_are_not_blamed_when_the_woken_rank_beats_on() -> None:
    """CI, job 880: the waiting ranks' collectives raised and they exited (their last beat says
    ended); SLURM's SIGCONT woke frozen rank 3, which beat on for seconds while it was stopped.
    Before: ranks 0, 1, 2 were named too, their last beats being 'older than the others''."""
    gave_up = [Beat(rank=r, node="n1", pid=100 + r, beat=20, time=100.0, step=10, phase="compute",
                    interval_s=0.8, ended=True) for r in range(3)]
    woke = Beat(rank=3, node="n2", pid=103, beat=9, time=106.0, step=10, phase="compute",
                interval_s=0.8, longest_pause_s=9.0)
    found = verdict([*gave_up, woke], 4)
    assert found.ranks == [3] and found.summary.startswith("rank 3 stopped answering")


def test_a_busy_nodes_short_pause_blames_nobody() -> None:
    """Four ranks on two cores delay a beat by a few intervals; a frozen rank pauses for ten."""
    busy = Beat(rank=1, node="n1", pid=101, beat=6, time=100.1, step=10, phase="compute",
                interval_s=1.0, longest_pause_s=3.5)
    assert verdict([beat(0, 100.0), busy, beat(2, 100.2)], 3).ranks == []
