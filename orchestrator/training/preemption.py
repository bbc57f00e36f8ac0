"""Preemption and time limits, handled at a step boundary instead of inside a signal handler.

A signal can arrive while a rank is inside an all-reduce; checkpointing from the handler there
(what submitit and Lightning do) saves a half-updated state or deadlocks. Here a handler only
records *that* a stop was asked for. After each optimizer step all ranks OR their flags together
(one tiny all-reduce), so they all stop at the same step, rank 0 writes the checkpoint while the
others wait, and only then is the job requeued.

Which signal means what:
- ``SIGUSR2``: SLURM's ``--signal=USR2@cluster.signal_delay_s`` before the time limit. Switchyard
  requeues the job itself (``scontrol requeue``), up to ``cluster.max_requeues`` times.
- ``SIGTERM``: preemption (or ``scancel``). The checkpoint is written; SLURM decides whether the job
  comes back (partitions with ``PreemptMode=REQUEUE`` requeue it), so Switchyard does not requeue.
"""

from __future__ import annotations

import subprocess

# One home for the signals, the reasons and the flag, shared with switchyard.preemption; re-exported
# here, where the trainer looks for them.
from orchestrator.stop_signals import STOP_SIGNALS as STOP_SIGNALS
from orchestrator.stop_signals import StopFlag as StopFlag
from orchestrator.stop_signals import StopReason as StopReason


class RequeueLimitError(RuntimeError):
    """The job hit its time limit more times than cluster.max_requeues allows."""


class JobStopped(SystemExit):
    """Raised on every rank after the checkpoint, to leave without writing a (fake) result;
    ``stop_reason`` names why (a StopReason's name: the memory plot marks the requeue with it)."""

    def __init__(self, code: int, stop_reason: str = "") -> None:
        super().__init__(code)
        self.stop_reason = stop_reason


def requeue(job_id: str) -> None:
    """Put this SLURM job back in the queue; it restarts with SLURM_RESTART_COUNT + 1."""
    # Array tasks are named ARRAYID_TASKID, which scontrol accepts as they are.
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {proc.stderr.strip()}")
