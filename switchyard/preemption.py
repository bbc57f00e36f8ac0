"""Preemption for your own script, run by ``switchyard run`` (importable without torch)::

    from switchyard import preemption

    preemption.install()                      # SIGUSR2 / SIGTERM now set a flag instead of killing
    state = load(preemption.checkpoint_dir())  # RUN/checkpoints: the same directory after a requeue
    for step in range(state.step, total):
        train_one_step()
        if preemption.stop_agreed():          # every rank, the same answer at the same step
            save(preemption.checkpoint_dir())  # rank 0, then a barrier
            preemption.requeue()              # exits with REQUEUE_EXIT_CODE: Switchyard requeues

SLURM sends SIGUSR2 ``cluster.signal_delay_s`` before the time limit and SIGTERM on preemption.
Exiting with :data:`REQUEUE_EXIT_CODE` puts the job back in the queue (up to
``cluster.max_requeues``), in the same run directory, with :func:`restart_count` one higher. A
script that does not answer the signal is requeued anyway, ``signal_delay_s / 2`` after it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

# The trainer's own flag (orchestrator/stop_signals.py imports the standard library alone).
from orchestrator.stop_signals import StopFlag, StopReason

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL ("try again"): exit with it to be requeued
RUN_DIR_ENV = "SWITCHYARD_RUN_DIR"
RESTART_ENV = "SWITCHYARD_RESTART_COUNT"

_flag = StopFlag()
_groups: dict[Any, Any] = {}  # default process group -> what stop_agreed() reduces over


def install() -> None:
    """SIGUSR2 (time limit) and SIGTERM (preemption) set the flag :func:`stop_requested` reads,
    instead of ending the process. Call it once, early; calling it again changes nothing."""
    _flag.install()


def stop_requested() -> bool:
    """A stop was asked for: checkpoint now, then :func:`requeue` (or just exit on preemption)."""
    return _flag.reason != StopReason.NONE


def stop_agreed() -> str | None:
    """:func:`reason`, agreed by every rank: on all of them, at the same call, the most severe
    reason any rank was signalled with, else None. Call it at the same point on every rank (after
    each step, or every few steps); one process, or no process group, is :func:`reason` itself.

    It reduces a CPU tensor over gloo (the default group when it is gloo, else a gloo group made
    at the first call), so on GPUs it never waits for the GPU's queue: Lightning's
    ``reduce_boolean_decision`` all-reduces a CUDA tensor and reads it with ``.item()``, a host-GPU
    sync at every call, and a CPU tensor on an NCCL-only group fails. The cost is one small gloo
    round trip between the ranks.
    """
    import torch  # here, not at the top: a script that never calls it loads no torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return reason()
    world = dist.group.WORLD
    if world not in _groups:  # once per process group (a script may make a new one)
        _groups.clear()
        _groups[world] = world if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    agreed = torch.tensor([int(_flag.reason)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=_groups[world])
    found = StopReason(int(agreed.item()))
    return None if found == StopReason.NONE else found.name.lower()


def reason() -> str | None:
    """``"preempted"`` (SIGTERM) over ``"time_limit"`` (SIGUSR2); None while nothing arrived."""
    found = _flag.reason
    return None if found == StopReason.NONE else found.name.lower()


def run_dir() -> Path:
    """The job's run directory (``SWITCHYARD_RUN_DIR``); a requeued job gets the same one."""
    value = os.environ.get(RUN_DIR_ENV)
    if not value:
        raise RuntimeError(f"{RUN_DIR_ENV} is not set: this process was not started by switchyard run "
                           f"(try switchyard run cluster=local -- python {Path(sys.argv[0]).name})")
    return Path(value)


def checkpoint_dir() -> Path:
    """``RUN/checkpoints``, created: where to save, and where a requeued job finds it again."""
    path = run_dir() / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


def restart_count() -> int:
    """0 on the first run, +1 per requeue."""
    return int(os.environ.get(RESTART_ENV, "0"))


def requeue() -> NoReturn:
    """Leave asking to be requeued: call it after the checkpoint is written (on every rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(REQUEUE_EXIT_CODE)
