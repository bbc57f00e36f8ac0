"""The NaN/inf guard: a loss or an evaluation that turned NaN or infinite never passes as a result.

``optim.on_nonfinite=stop`` (the default): the first step whose loss was NaN or infinite on this
rank is kept on the device (no host read per step) and read where the host syncs anyway, at log
steps and before each checkpoint; the run then fails on every rank, naming that step, and no
checkpoint of the weights those steps made is written. ``skip``: a step whose loss (and, without
an fp16 grad scaler, whose gradients) are not finite on some rank is skipped on every rank (one
all-reduced flag per step, read on the host: skip's cost), and the run fails once
``log_every_steps`` steps in a row were skipped.

An evaluation's metrics are global (every rank reduced the same sums), so every rank sees the same
non-finite value at the same step and fails together: no rank is left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from orchestrator.config import OptimConfig
from orchestrator.training.runtime import Runtime

NO_STEP = 2**62  # NonFiniteGuard.first while every step's loss was finite


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite (``optim.on_nonfinite``)."""


class NonFiniteEvalError(RuntimeError):
    """An evaluation gave a NaN or infinite metric: its set's targets or inputs hold NaN or inf, or
    the model's output overflowed on them."""


class NonFiniteGuard:
    def __init__(self, cfg: OptimConfig, log_every_steps: int, rt: Runtime) -> None:
        self.cfg, self.log_every_steps, self.rt = cfg, log_every_steps, rt
        self.first = torch.full((), NO_STEP, dtype=torch.int64, device=rt.device)  # stop: on the device
        self.skipped_steps: list[int] = []  # skip: the steps skipped, and how many in a row
        self.skipped_in_a_row = 0

    def note(self, step: int, loss_sum: torch.Tensor) -> None:
        """stop: remember ``step`` if its loss is the first non-finite one (device ops only)."""
        if self.cfg.on_nonfinite == "stop":
            self.first.masked_fill_(~torch.isfinite(loss_sum) & (self.first == NO_STEP), step)

    def update_allowed(self, step: int, loss_sum: torch.Tensor,
                       grad_norm: Callable[[], torch.Tensor] | None) -> bool:
        """skip: whether ``step``'s loss, and its gradients' global norm (``grad_norm``; None where
        a grad scaler handles overflowing gradients by lowering its scale), are finite on every
        rank. A collective and one host read. stop: always (``check`` reads the flag later)."""
        if self.cfg.on_nonfinite != "skip":
            return True
        bad = ~torch.isfinite(loss_sum)
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm())
        flag = bad.to(torch.int64).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not flag.item():
            self.skipped_in_a_row = 0
            return True
        self.note_skipped(step)
        return False

    def note_skipped(self, step: int) -> None:
        self.skipped_steps.append(step)
        self.skipped_in_a_row += 1
        if self.rt.is_main:
            print(f"warning: step {step}: the loss or a gradient is NaN or infinite on some rank; its "
                  f"update was skipped (optim.on_nonfinite=skip)", flush=True)
        if self.skipped_in_a_row >= self.log_every_steps:  # the model no longer trains
            raise NonFiniteLossError(
                f"the last {self.skipped_in_a_row} steps (to step {step}) all had a NaN or infinite "
                f"loss or gradient and were skipped (optim.on_nonfinite=skip): the model no longer "
                f"trains. {self.advice()}")

    def check(self, step: int, saved_step: int, checkpoint_dir: Path) -> None:
        """stop: fail on every rank, naming the first step whose loss was NaN or infinite on any
        rank. A collective and one host read: log steps and checkpoints only."""
        first = self.first.clone()
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
        bad = int(first.item())
        if bad == NO_STEP:
            return
        saved = f"step {saved_step}" if saved_step > 0 else "none"
        raise NonFiniteLossError(
            f"the training loss was NaN or infinite at step {bad} (optim.on_nonfinite=stop): the run "
            f"stopped at step {step} without checkpointing the weights those steps made "
            f"(newest checkpoint: {saved}, in {checkpoint_dir}). {self.advice()}")

    def advice(self) -> str:
        return (f"Try a lower optim.lr (now {self.cfg.lr}), optim.clip_grad_norm=1.0, or check "
                f"the data for NaN; optim.on_nonfinite=skip skips such steps instead")


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(value) for value in metrics.values())


def check_eval(metrics: dict[str, float], step: int, eval_path: str | None, saved: str) -> None:
    """Raise naming the eval set, every non-finite metric and the step; ``saved``: where the run's
    newest checkpoint is, for the message."""
    if all_finite(metrics):
        return
    values = ", ".join(f"{name}={value}" for name, value in metrics.items() if not math.isfinite(value))
    raise NonFiniteEvalError(
        f"evaluation at step {step} gave {values} on the eval set data.eval_path={eval_path!r}: its "
        f"targets or inputs hold NaN or infinite values, or the model's output overflowed on them; "
        f"the run stopped ({saved}). Fix or replace the eval set (the training data was finite), or "
        f"set data.eval_path=null to train without evaluation")
