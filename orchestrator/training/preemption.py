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
from pathlib import Path
from typing import Any, NoReturn

import torch

from orchestrator.launch.dist_env import DistEnv

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


class StopPoll:
    """The preemption flag, OR-ed over ranks without a synchronous round trip per step.

    Each step starts an asynchronous all-reduce of this rank's flag and reads the previous step's
    result: every rank reads the same reduced value at the same step, so they all stop together,
    one step after the signal, and the latency hides behind the step's compute.

    The flag is a CPU tensor on purpose: on a GPU run it goes over the group's gloo backend, never
    onto the GPU's stream, and reading it is no host-device sync (Lightning broadcasts its flag as a
    GPU tensor and reads it with ``.item()`` every step, which stalls the GPU).
    """

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self.pending: tuple[torch.Tensor, Any] | None = None

    def poll(self) -> StopReason:
        decided = StopReason.NONE
        if self.pending is not None:
            buffer, work = self.pending
            work.wait()
            decided = StopReason(int(buffer.item()))
        buffer = torch.tensor([int(self.flag.reason)], dtype=torch.int64, device="cpu")
        self.pending = (buffer, torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX,
                                                             async_op=True))
        return decided

    def drain(self) -> None:
        """Wait for the last reduction (every rank started it; none may leave it unfinished)."""
        if self.pending is not None:
            self.pending[1].wait()
            self.pending = None


def leave(reason: StopReason, env: DistEnv, max_requeues: int, step: int, checkpoint_dir: Path,
          run_dir: Path) -> NoReturn:
    """Every rank, once the checkpoint of ``step`` is on disk: requeue (the time limit, on SLURM,
    up to ``cluster.max_requeues``) or leave it to SLURM (preemption), then exit."""
    if reason == StopReason.TIME_LIMIT and env.source == "slurm":
        if env.restart_count >= max_requeues:
            raise RequeueLimitError(
                f"job {env.job_id} reached its time limit again after {env.restart_count} requeues "
                f"(cluster.max_requeues={max_requeues}); checkpoint at step {step} is in "
                f"{checkpoint_dir}. Raise cluster.max_requeues or cluster.timeout_min, or "
                f"rerun with hydra.run.dir={run_dir} to continue.")
        if env.is_main:
            # Said first: SLURM stops every rank as soon as the requeue is taken (SIGTERM, then
            # SIGKILL after its KillWait), and on a loaded node that came before a line printed
            # after ``scontrol`` returned.
            print(f"requeueing job {env.job_id} at step {step} "
                  f"({env.restart_count + 1}/{max_requeues} requeues)", flush=True)
            requeue(env.job_id)
    elif env.is_main:
        print(f"stopped by {reason.name} at step {step}; checkpoint in {checkpoint_dir}", flush=True)
    raise JobStopped(-1, reason.name)
