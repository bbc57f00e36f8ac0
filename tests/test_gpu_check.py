"""``bench/gpu_check.py``'s verdicts, which only a GPU machine reaches otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check


class Rows(gpu_check.Check):
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []


@pytest.mark.parametrize(("compiled", "verdict"), [
    ([4.584, 3.393, 2.819], "ok"),  # rounding compounding: what the CPU's bf16 runs showed
    ([4.700, 3.393, 2.819], "DIFFERS"),  # off from the first window: the compiled code's doing
    ([4.584, 3.393, 3.100], "DIFFERS"),  # the GPU's 2026-11-28 gap (2.931 against 3.159)
    ([], "DIFFERS"),  # nothing logged: nothing shown equal
])
def test_a_compiled_run_is_compared_window_by_window(compiled: list[float], verdict: str) -> None:
    rows = Rows()
    gpu_check.compare_losses(rows, "pair", [4.584, 3.393, 2.818], compiled)
    [(check, result, detail)] = rows.rows
    assert (check, result) == ("pair", verdict)
    if compiled:
        steps = gpu_check.LOSS_WINDOW_STEPS
        assert detail.startswith(f"loss per {steps} steps, eager / compiled (gap): 4.584/")
