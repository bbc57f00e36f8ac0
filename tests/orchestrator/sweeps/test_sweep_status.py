"""`switchyard status`: tables, colours only on a terminal, progress from metrics.jsonl, names."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.registry.db import SINGLE_NUM, Job, Observation, Registry, Submitted
from orchestrator.registry.status_file import TaskStatus
from orchestrator.sweeps.results import last_metrics
from orchestrator.sweeps.status import (
    CommandError,
    Ref,
    cmd_show,
    cmd_status,
    format_duration,
    parse_ref,
    render_table,
    varying,
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _finished_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """A local sweep of 3 jobs: completed (with metrics), failed, and never reported on."""
    reg = Registry(tmp_path / "r.db")
    sweep_id = reg.create_sweep("train", "optim.lr=0.1,0.2,0.3 seed=1", str(tmp_path), "local", "entry")
    reg.add_jobs(Job(sweep_id, n, [f"optim.lr=0.{n + 1}", "seed=1"], str(tmp_path / str(n)), {}, 20)
                 for n in range(3))
    claims = reg.claim(sweep_id, range(3))
    pid = str(_finished_pid())
    reg.confirm([Submitted(claims[0], pid, None, None, str(tmp_path / "logs"))])
    TaskStatus(pid, started_at=100.0, node="n1", ended_at=165.0, exit_code=0).write(tmp_path / "0")
    (tmp_path / "0" / "metrics.jsonl").write_text(
        '{"step": 10, "train_loss": 0.9}\n{"step": 20, "train_loss": 0.25}\n{"step": 2')
    reg.observe([Observation(claims[1], "FAILED", exit_code=1, error="ValueError: boom")])
    return reg


def test_piped_status_is_a_plain_table_with_progress_loss_and_runtime(registry: Registry) -> None:
    out = io.StringIO()
    assert cmd_status(registry, "1", as_json=False, out=out) == 0
    text = out.getvalue()
    assert "\033[" not in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB "))
    rows = [line.split() for line in lines[header + 1:]]
    assert rows[0][:2] == ["1/0", "COMPLETED"] and "20/20" in rows[0] and "0.2500" in rows[0]
    assert "0:01:05" in rows[0] and rows[0][-1] == "optim.lr=0.1"  # seed=1 is shared: not repeated
    assert rows[1][:2] == ["1/1", "FAILED"]
    assert rows[2][:2] == ["1/2", "SUBMITTING"]
    assert "1 completed, 1 failed, 1 submitting" in lines[0]


def test_a_terminal_gets_colours_and_json_gets_everything(registry: Registry) -> None:
    tty = Terminal()
    cmd_status(registry, "1", as_json=False, out=tty)
    assert "\033[32mCOMPLETED" in tty.getvalue() and "\033[31mFAILED" in tty.getvalue()
    out = io.StringIO()
    cmd_status(registry, "1", as_json=True, out=out)
    jobs = json.loads(out.getvalue())["jobs"]
    assert (jobs[0]["step"], jobs[0]["loss"], jobs[0]["runtime_s"], jobs[0]["node"]) == (20, 0.25, 65.0, "n1")
    assert jobs[1]["error"] == "ValueError: boom"


def test_sweeps_list_counts_states(registry: Registry) -> None:
    out = io.StringIO()
    cmd_status(registry, None, as_json=False, out=out)
    header, row = out.getvalue().splitlines()
    assert header.split()[:10] == ["SWEEP", "CREATED", "APP", "EXECUTOR", "JOBS", "DONE", "ACTIVE",
                                   "FAILED", "CANCELLED", "COMMAND"]
    fields = row.split()
    assert fields[0] == "1" and fields[3:10] == ["train", "local", "3", "1", "1", "1", "0"]


def test_sweeps_list_counts_cancelled_jobs_apart_from_failed_ones(registry: Registry) -> None:
    """A job someone cancelled is not broken: under FAILED it sent the user looking for an error."""
    claims = registry.claim(1, [2])
    registry.observe([Observation(claims[2], "CANCELLED", error="cancelled by the user")])
    out = io.StringIO()
    cmd_status(registry, None, as_json=False, out=out)
    header, row = out.getvalue().splitlines()
    counts = dict(zip(header.split()[4:9], row.split()[5:10], strict=True))
    assert counts == {"JOBS": "3", "DONE": "1", "ACTIVE": "0", "FAILED": "1", "CANCELLED": "1"}


def test_show_prints_the_saved_config(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "0" / ".switchyard" / "config.yaml").write_text("optim:\n  lr: 0.1\n")
    out = io.StringIO()
    cmd_show(registry, "1/0", as_json=False, out=out)
    assert "overrides: optim.lr=0.1 seed=1" in out.getvalue()
    assert out.getvalue().endswith("optim:\n  lr: 0.1\n")


def test_jobs_are_named_by_sweep_and_number_or_by_slurm_id(registry: Registry) -> None:
    pid = registry.latest_attempts(1)[0].slurm_id
    assert parse_ref(registry, "1") == Ref(1)
    assert parse_ref(registry, "1/2") == Ref(1, 2)
    assert parse_ref(registry, str(pid)) == Ref(1, 0)
    with pytest.raises(CommandError, match="'4711_3' names nothing"):
        parse_ref(registry, "4711_3")


def test_table_helpers() -> None:
    assert render_table(["A", "LONGER"], [["xyz", "1"], ["x", "22"]]) == "A    LONGER\nxyz  1\nx    22"
    assert format_duration(3725.9) == "1:02:05" and format_duration(None) == "-"
    jobs = [Job(1, n, ["a=1", f"b={n}"], "", {}, None) for n in range(2)]
    assert varying(jobs) == {0: ["b=0"], 1: ["b=1"]}


def test_last_metrics_skips_a_line_being_written(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "train_loss": 1.5}\n{"step": 1')
    assert last_metrics(str(tmp_path)) == {"step": 5, "train_loss": 1.5}
    assert last_metrics(str(tmp_path / "missing")) is None


def test_logs_of_a_rank_the_job_does_not_have_name_its_ranks(tmp_path: Path) -> None:
    """--rank 7 of a 2-rank job read as a log "not written yet": waiting would never help."""
    from orchestrator.sweeps.status import cmd_logs

    reg = Registry(tmp_path / "r.db")
    sweep_id = reg.create_sweep("train", "", str(tmp_path), "local", "entry")
    resources = {"executor": "local", "params": {"nodes": 1, "tasks_per_node": 2}, "max_requeues": 0,
                 "array_parallelism": 1, "source": "cluster"}
    reg.add_jobs([Job(sweep_id, 0, [], str(tmp_path / "0"), resources, None)])
    claims = reg.claim(sweep_id, range(1))
    reg.confirm([Submitted(claims[0], str(_finished_pid()), None, None, str(tmp_path / "logs"))])
    for rank in (7, 2, -1):
        with pytest.raises(CommandError) as refused:
            cmd_logs(reg, f"{sweep_id}/0", rank, follow=False, stream="both", out=io.StringIO())
        assert str(refused.value) == f"--rank {rank} is invalid: job 1/0 has 2 ranks (0..1) (try --rank 0)"
    out = io.StringIO()
    assert cmd_logs(reg, f"{sweep_id}/0", 1, follow=False, stream="out", out=out) == 0
    assert "not written yet" in out.getvalue()


def test_a_single_jobs_provenance_is_kept_in_the_registry(tmp_path: Path) -> None:
    from orchestrator.launch import provenance, single

    run_dir = tmp_path / "run"
    written = provenance.record(run_dir, None, "seed: 1\n", provenance.origin(), None)
    recorded = single.record("train", "seed=1", run_dir, "local", "4242", tmp_path / "logs", ["seed=1"],
                             "seed: 1\n", tmp_path / "reg.db")
    (run_dir / provenance.PROVENANCE_FILE).unlink()
    with Registry(tmp_path / "reg.db") as reg:
        assert reg.provenance(recorded.sweep_id, SINGLE_NUM) == written
        out = io.StringIO()
        cmd_show(reg, recorded.ref, as_json=False, out=out)
    assert "code snapshot: none (the job imported the working tree)" in out.getvalue()
