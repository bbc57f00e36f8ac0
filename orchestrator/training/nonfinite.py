"""The NaN/inf guard: a loss or an evaluation that turned NaN or infinite never passes as a result.

An evaluation's metrics are global (every rank reduced the same sums), so every rank sees the same
non-finite value at the same step and fails together: no rank is left waiting in a collective.
"""

from __future__ import annotations

import math


class NonFiniteEvalError(RuntimeError):
    """An evaluation gave a NaN or infinite metric: its set's targets or inputs hold NaN or inf, or
    the model's output overflowed on them."""


def check_eval(metrics: dict[str, float], step: int, eval_path: str | None, saved: str) -> None:
    """Raise naming the eval set, every non-finite metric and the step; ``saved``: where the run's
    newest checkpoint is, for the message."""
    bad = {name: value for name, value in metrics.items() if not math.isfinite(value)}
    if not bad:
        return
    values = ", ".join(f"{name}={value}" for name, value in bad.items())
    raise NonFiniteEvalError(
        f"evaluation at step {step} gave {values} on the eval set data.eval_path={eval_path!r}: its "
        f"targets or inputs hold NaN or infinite values, or the model's output overflowed on them; "
        f"the run stopped ({saved}). Fix or replace the eval set (the training data was finite), or "
        f"set data.eval_path=null to train without evaluation")
