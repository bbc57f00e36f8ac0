"""What the submitting command shows while it follows a job (issue 53, item 8): the queue state,
then rank 0's steps/total, samples/s, loss and ETA, read from the files the ranks write."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from train_helpers import CHEAP, run_train

from orchestrator.launch import progress
from orchestrator.launch.heartbeat import heartbeat_dir


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def write_run(run_dir: Path, beat_step: int, lines: list[dict[str, object]]) -> None:
    heartbeat_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (heartbeat_dir(run_dir) / "rank-0.json").write_text(json.dumps({"step": beat_step, "phase": "forward"}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_rank_0s_progress_is_read_from_its_heartbeat_and_metrics(tmp_path: Path) -> None:
    assert progress.read(tmp_path) == progress.Seen()  # nothing written yet
    write_run(tmp_path, 130, [{"step": 120, "train_loss": 0.5, "samples_per_s": 1234.0, "t": 1.0},
                              {"step": 120, "eval_loss": 0.7, "t": 2.0}, '{"step": 125, "train_lo'])  # type: ignore[list-item]
    assert progress.read(tmp_path) == progress.Seen(step=130, loss=0.5, samples_per_s=1234.0)


def test_a_line_says_steps_of_total_rate_loss_and_eta() -> None:
    seen = progress.Seen(step=120, loss=0.43214, samples_per_s=12345.6)
    assert progress.describe(seen, 3000, 130.0) == \
        "rank 0: step 120/3000 (4%), 12,346 samples/s, loss 0.4321, ETA 2 min"
    assert progress.describe(progress.Seen(step=7), None, None) == "rank 0: step 7"
    assert [progress.duration(s) for s in (5, 61, 7500)] == ["5 s", "1 min", "2 h 05 min"]


def test_the_eta_comes_from_the_steps_seen_while_following(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = Terminal()
    follower = progress.Follower(tmp_path, 1000, progress.Display(out))
    write_run(tmp_path, 500, [])  # a resumed run: its first 500 steps are not this follower's
    follower.poll()
    write_run(tmp_path, 600, [{"step": 600, "train_loss": 0.25, "samples_per_s": 80.0}])
    follower.poll()  # 100 steps in 10 s: 400 more take 40 s
    assert out.getvalue().endswith("\rrank 0: step 600/1000 (60%), 80 samples/s, loss 0.2500, ETA 40 s\x1b[K")


def test_a_terminal_line_is_redrawn_and_cleared_and_a_pipe_gets_a_line_now_and_then() -> None:
    tty = progress.Display(Terminal())
    tty.pending("42", "PENDING", "Priority", 185)
    tty.show("rank 0: step 1/2 (50%)")
    tty.clear()
    assert tty.stream.getvalue() == ("\rjob 42: PENDING (Priority), waited 3 min\x1b[K"  # type: ignore[attr-defined]
                                     "\rrank 0: step 1/2 (50%)\x1b[K\r\x1b[K")
    pipe = progress.Display(io.StringIO(), line_every_s=3600)
    pipe.pending("42", "PENDING", "Priority", 10)
    pipe.pending("42", "PENDING", "Priority", 70)  # within the hour: not written
    pipe.show("rank 0: step 0/2 (0%)", "started")
    pipe.show("rank 0: step 1/2 (50%), loss 0.1000", "progress")  # the first with a loss: at once
    pipe.show("rank 0: step 2/2 (100%), loss 0.0500", "progress")
    pipe.clear()
    assert pipe.stream.getvalue() == ("job 42: PENDING (Priority), waited 10 s\n"  # type: ignore[attr-defined]
                                      "rank 0: step 0/2 (0%)\nrank 0: step 1/2 (50%), loss 0.1000\n")


SLOW_MODEL = '''
import time

from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """The built-in MLP, slowed so that the run lasts several of the follower's polls."""

    def forward(self, *args, **kwargs):
        time.sleep(0.05)
        return super().forward(*args, **kwargs)
'''


def test_a_local_run_shows_rank_0s_progress_while_it_trains(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a pipe (not a terminal): whole lines, no carriage return; stdout as before."""
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    run_dir = tmp_path / "run"
    proc = run_train(*CHEAP, "model=custom", "model._target_=slow.Net", "optim.max_steps=80",
                     "log_every_steps=5", "data.demo_num_samples=256", "data.batch_size=16",
                     run_dir=run_dir, cache_dir=tmp_path.parent / "demo-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == f"run_dir: {run_dir}"
    shown = [line for line in proc.stderr.splitlines() if line.startswith("rank 0: step")]
    line_with_loss = r"rank 0: step \d+/80 \(\d+%\), [\d,]+ samples/s, loss \d+\.\d{4}(, ETA .+)?"
    assert any(re.fullmatch(line_with_loss, line) for line in shown), proc.stderr
    assert "\r" not in proc.stderr
