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


AGREE = """
import os, signal, sys, datetime
import torch.distributed as dist
from switchyard import preemption
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
preemption.install()
seen = []
for call in range(4):
    if call == 2 and rank == 1:
        os.kill(os.getpid(), signal.SIGUSR2)  # one rank only, as a node's signal can come first
    seen.append(preemption.stop_agreed())
print(seen, flush=True)
dist.barrier()  # neither rank tears gloo down while the other is still in the last all-reduce
dist.destroy_process_group()
os._exit(0)  # not the interpreter's finalisation of torch: it once aborted here (std::terminate)
"""


def test_stop_agreed_gives_every_rank_the_same_answer_at_the_same_call(tmp_path: Path) -> None:
    """Rank 1 alone is signalled before its third call: both ranks' third call says so. Without
    the agreement rank 0 would train on alone and hang in its next collective."""
    ranks = [subprocess.Popen([sys.executable, "-c", AGREE, str(tmp_path / "store"), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outs]
    expected = str([None, None, "time_limit", "time_limit"])
    assert [out.strip() for out, _ in outs] == [expected, expected]


def test_stop_agreed_on_one_process_is_the_flag_itself(handlers: None) -> None:
    preemption.install()
    assert preemption.stop_agreed() is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.stop_agreed() == "preempted"
