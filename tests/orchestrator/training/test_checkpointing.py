"""The checkpoint interface: an asynchronous save writes the bytes a blocking one writes, the step
loop may change the weights as soon as save returns, a background failure is raised at the next
step boundary naming the path, and a writer killed mid-write leaves the previous checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from orchestrator.config import CheckpointConfig
from orchestrator.training import checkpoint, checkpointing, runtime
from orchestrator.training.checkpoint import CheckpointError


def model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # the optimizer has state to save
    return model, optimizer


def saver(rt: runtime.Runtime, directory: Path, async_save: bool) -> checkpointing.SingleFile:
    cfg = CheckpointConfig(keep_last=3, async_save=async_save)
    return checkpointing.SingleFile(rt, cfg, directory, module=lambda m: m)


def train_state(step: int) -> dict[str, object]:
    return {"step": step, "schedule": {"last_epoch": step}, "world_size": 1}


def test_an_async_save_writes_the_bytes_a_blocking_save_writes(rank: runtime.Runtime, tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    blocking = saver(rank, tmp_path / "sync", async_save=False)
    blocking.save(7, model, optimizer, train_state(7), blocking=False)
    background = saver(rank, tmp_path / "async", async_save=True)
    background.save(7, model, optimizer, train_state(7), blocking=False)
    with torch.no_grad():  # the loop goes on at once: the saved state must not see this
        for p in model.parameters():
            p.add_(1.0)
    background.wait()
    name = checkpoint.path_for(Path(), 7).name
    assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes()
    assert checkpoint.verify(tmp_path / "async" / name)
    assert background.stats.saves == 1 and background.stats.save_s > 0


def test_a_second_save_waits_for_the_first_and_reuses_its_buffers(rank: runtime.Runtime,
                                                                  tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    background = saver(rank, tmp_path, async_save=True)
    background.save(1, model, optimizer, train_state(1), blocking=False)
    buffers = dict(background.host.buffers)
    background.save(2, model, optimizer, train_state(2), blocking=False)
    background.wait()
    assert all(background.host.buffers[k] is v for k, v in buffers.items())
    assert [step for step, _ in checkpoint.listed(tmp_path)] == [2, 1]
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 2
    restored, restored_optimizer = model_and_optimizer(seed=1)
    background.load(found, restored, restored_optimizer)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_background_failure_is_raised_at_the_next_step_naming_the_path(
        rank: runtime.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = model_and_optimizer()
    background = saver(rank, tmp_path, async_save=True)

    def full_disk(directory: Path, step: int, state: object, keep_last: int) -> Path:
        time.sleep(0.2)
        raise OSError(errno.ENOSPC, "No space left on device", str(checkpoint.path_for(directory, step)))

    monkeypatch.setattr(checkpoint, "save", full_disk)
    background.save(3, model, optimizer, train_state(3), blocking=False)
    background.poll()  # still writing: nothing to report yet, and no wait
    time.sleep(0.5)
    with pytest.raises(CheckpointError, match=r"the background save of .*step-000000003.pt failed: "
                                              r"OSError: .*No space left on device"):
        background.poll()
    background.poll()  # reported once


KILLED_WRITER = """
import sys, time, torch
from pathlib import Path
from orchestrator.training import checkpoint

class Slow:
    def __reduce__(self):
        time.sleep(60)  # the background save is mid-write when the process is killed
        return (int, (0,))

directory = Path(sys.argv[1])
checkpoint.save(directory, 10, {"step": 10, "w": torch.zeros(4)}, keep_last=3)
print("saved", flush=True)
checkpoint.save(directory, 20, {"step": 20, "w": torch.ones(1 << 20), "slow": Slow()}, keep_last=3)
"""


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".step-000000020.pt.*.tmp")):
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 10 and found.verified
    checkpoint.save(tmp_path, 30, {"step": 30}, keep_last=3)  # the next run's first save
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_stop_during_a_background_save_waits_for_it_then_saves_its_own_step(
        rank: runtime.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preemption signal arrives while step 10's save is still being written: the blocking save
    of the stop (step 12) returns only once both are on disk, whole, step 12 the newest."""
    model, optimizer = model_and_optimizer()
    background = saver(rank, tmp_path, async_save=True)
    real_save, released = checkpoint.save, threading.Event()
    writing = []

    def slow_save(directory: Path, step: int, state: object, keep_last: int) -> Path:
        writing.append(step)
        if step == 10:
            released.wait(30)  # still writing when the stop's save begins
        return real_save(directory, step, state, keep_last)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint, "save", slow_save)
    background.save(10, model, optimizer, train_state(10), blocking=False)
    assert not checkpoint.listed(tmp_path), "the first save runs in the background"
    released.set()
    background.save(12, model, optimizer, train_state(12), blocking=True)
    assert writing == [10, 12]
    assert [step for step, _ in checkpoint.listed(tmp_path)] == [12, 10]
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 12 and found.verified
    assert background.pending is None and background.stats.saves == 2
