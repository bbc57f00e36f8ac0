"""``bench/gpu_check.py``'s verdicts, which only a GPU machine reaches otherwise."""

from __future__ import annotations

import json
import sys
import tarfile
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


def test_the_steps_that_never_ran_come_first_then_the_oldest() -> None:
    state = {"steps": {"tests": {"date": "2026-11-28"}, "fsdp": {"date": "2026-11-27"},
                       "causal_lm": {"date": "2026-11-28"}}}
    assert gpu_check.order_steps(["tests", "fsdp", "causal_lm", "leads", "telemetry"], state) == \
        ["leads", "telemetry", "fsdp", "causal_lm", "tests"]
    assert gpu_check.order_steps(list(gpu_check.STEPS), {"steps": {}}) == list(gpu_check.STEPS)


RESULTS = {"date": "2026-12-03", "commit": "abc1234", "command": "bench/gpu_check.py --only causal_lm",
           "machine": {"gpu": "NVIDIA H200", "gpus": 1, "memory_mib": 143771, "driver": "580.159.04",
                       "python": "3.12.3", "torch": "2.11.0+cu130", "cores": 16},
           "steps": {"causal_lm": 412.3},
           "rows": [("gpt b8 ddp eager", "ok", "281,120 tokens/s"),
                    ("gpt b8 eager: switchyard ddp / reference", "BELOW", "0.90x (target 0.95x): a | b")]}


def test_the_dated_table_is_rendered_from_the_results() -> None:
    assert gpu_check.render_table(RESULTS) == (
        "## What ran on NVIDIA H200 x 1 (2026-12-03, gpu_check)\n\n"
        "1 x NVIDIA H200 (143,771 MiB), driver 580.159.04, Python 3.12.3, torch 2.11.0+cu130, 16 cores; "
        "`bench/gpu_check.py --only causal_lm` at commit abc1234; steps (s): causal_lm 412.\n\n"
        "| check | result | detail |\n|---|---|---|\n"
        "| gpt b8 ddp eager | ok | 281,120 tokens/s |\n"
        "| gpt b8 eager: switchyard ddp / reference | BELOW | 0.90x (target 0.95x): a / b |\n")


def test_the_table_goes_above_the_newest_run_and_the_state_records_the_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "gpus.md"
    page.write_text("# Running on GPUs\n\nintro\n\n## What ran on an H200 (2026-11-28)\n\nold\n")
    monkeypatch.setattr(gpu_check, "GPUS_PAGE", page)
    monkeypatch.setattr(gpu_check, "STATE", tmp_path / "gpu_runs.json")
    out = tmp_path / "out"
    out.mkdir()
    gpu_check.record(RESULTS, {"steps": {"tests": {"date": "2026-11-28"}}}, out, write_here=True)
    text = page.read_text()
    assert text.startswith("# Running on GPUs\n\nintro\n\n## What ran on NVIDIA H200 x 1 (2026-12-03")
    assert text.index("(2026-12-03, gpu_check)") < text.index("## What ran on an H200 (2026-11-28)")
    assert text.endswith("\n\n## What ran on an H200 (2026-11-28)\n\nold\n")
    state = json.loads((tmp_path / "gpu_runs.json").read_text())
    assert state["steps"]["causal_lm"] == {"date": "2026-12-03", "gpu": "NVIDIA H200", "commit": "abc1234"}
    assert state["steps"]["tests"] == {"date": "2026-11-28"}
    assert (out / "gpu_runs.json").read_text() == (tmp_path / "gpu_runs.json").read_text()
    assert (out / "gpus-section.md").read_text() == gpu_check.render_table(RESULTS)
    assert gpu_check.order_steps(["tests", "causal_lm", "leads"], state) == ["leads", "tests", "causal_lm"]


def test_a_ratio_row_says_below_its_target_and_not_reached_without_a_pair() -> None:
    rows = Rows()
    ours, base = gpu_check.LmRun([1.0, 90.0, 91.0, 89.0], []), gpu_check.LmRun([1.0, 100.0, 100.0], [])
    gpu_check.side_by_side(rows, "pair", ours, base, 0.95)
    gpu_check.side_by_side(rows, "pair", base, base, 0.95)
    gpu_check.side_by_side(rows, "pair", None, base, 0.95)
    assert [r[1] for r in rows.rows] == ["BELOW", "ok", "not reached"]
    assert rows.rows[0][2] == "0.90x (target 0.95x): 90 / 100 tokens/s"  # medians after the first window


def test_the_pair_runs_side_by_side_on_the_cpu_with_their_profiles(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU session runs first, through the same functions, on a tiny GPT on the CPU: both
    sides train, profile, and compute the same losses (gpu_check's own loss comparison)."""
    monkeypatch.setattr(gpu_check, "LM_MODEL", {"d_model": 32, "layers": 2, "heads": 2, "seq_len": 32})
    monkeypatch.setattr(gpu_check, "LM_STEPS", {4: 20})  # the profile: steps 12 and 13
    monkeypatch.setattr(gpu_check, "PROFILE_STEPS", 2)
    out = tmp_path / "out"
    out.mkdir()
    c = gpu_check.Check(tmp_path, out)
    data = c.corpus()
    ours = gpu_check.switchyard_lm(c, "gpt b4 ddp eager", gpu_check.lm_overrides(
        data, 4, "ddp", False, 0, True, "telemetry.enabled=false"))
    base = gpu_check.reference_lm(c, "gpt b4 reference eager", data, 4, False, True)
    assert ours is not None and base is not None, c.rows
    gpu_check.compare_losses(c, "losses", base.losses, ours.losses, ("reference", "switchyard"))
    gpu_check.pack_profiles(c)
    checks = [(check, result) for check, result, _ in c.rows]
    assert checks == [("gpt b4 ddp eager", "ok"), ("profile: gpt b4 ddp eager", "ok"),
                      ("gpt b4 reference eager", "ok"), ("profile: gpt b4 reference eager", "ok"),
                      ("losses", "ok")], c.rows
    assert len(ours.rates) == len(base.rates) == 2 and ours.classes and base.classes
    assert ours.classes["matmul"] > 0 and base.classes["matmul"] > 0
    with tarfile.open(out / "profiles-1.tar.gz") as tar:
        names = tar.getnames()
    assert "gpt-b4-ddp-eager/rank-0.trace.json" in names
    assert "gpt-b4-reference-eager/reference.trace.json" in names
