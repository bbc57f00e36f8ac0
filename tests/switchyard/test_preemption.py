"""switchyard.preemption: the helper a user's script imports, light and in step with the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.launch import rank_env
from orchestrator.scripts import rank
from orchestrator.stop_signals import StopFlag
from switchyard import preemption


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    monkeypatch.setattr(preemption, "_flag", StopFlag())  # a fresh flag, as in a new process
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_importing_it_loads_neither_torch_nor_the_orchestrator_beyond_its_stop_flag() -> None:
    code = ("import sys; from switchyard import preemption; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'orchestrator', 'submitit', 'hydra', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['orchestrator', 'orchestrator.stop_signals']"


def test_a_signal_sets_the_flag_instead_of_ending_the_process(handlers: None) -> None:
    preemption.install()
    assert not preemption.stop_requested() and preemption.reason() is None
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.stop_requested() and preemption.reason() == "time_limit"
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.reason() == "preempted"


def test_requeue_exits_with_the_code_the_ranks_requeue_on() -> None:
    with pytest.raises(SystemExit) as exited:
        preemption.requeue()
    assert exited.value.code == preemption.REQUEUE_EXIT_CODE == rank.REQUEUE_EXIT_CODE
    assert (preemption.RUN_DIR_ENV, preemption.RESTART_ENV) == (rank_env.RUN_DIR_ENV, rank_env.RESTART_ENV)


def test_the_run_directory_comes_from_switchyard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(preemption.RUN_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match="not started by switchyard run"):
        preemption.run_dir()
    monkeypatch.setenv(preemption.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(preemption.RESTART_ENV, "2")
    assert preemption.checkpoint_dir() == tmp_path / "checkpoints" and (tmp_path / "checkpoints").is_dir()
    assert preemption.restart_count() == 2
