"""`switchyard status` and `show` at scale: what an ended job left is read once and kept, rows are
decoded once, SLURM is asked only about what is shown, its reply is matched in linear work, and a
failed SLURM query is reported instead of dropped.

Where SLURM must answer in a way the real one cannot be made to (fail), its commands are small
scripts first on PATH (tests/slurm_fakes.py).
"""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import opened_samples
from slurm_fakes import calls, fake_slurm

from orchestrator import cli
from orchestrator.launch import slurm_query
from orchestrator.registry import db, reconciliation
from orchestrator.registry.db import Attempt, Job, Observation, Registry, Result, Submitted
from orchestrator.registry.states import SUBMITTED
from orchestrator.sweeps import results
from orchestrator.sweeps.status import cmd_show, cmd_status
from orchestrator.telemetry import files, fold
from orchestrator.telemetry.summary import summarize

GIB = 2**30


def slurm_sweep(reg: Registry, tmp_path: Path, num_jobs: int) -> tuple[int, dict[int, int]]:
    """A SLURM sweep whose jobs are each their own array (``10N_0``), submitted."""
    sweep_id = reg.create_sweep("train", "x=...", str(tmp_path), "slurm", "entry.pkl")
    reg.add_jobs(Job(sweep_id, n, [f"x={n}"], str(tmp_path / str(n)), {"executor": "slurm"}, 20)
                 for n in range(num_jobs))
    claims = reg.claim(sweep_id, range(num_jobs))
    reg.confirm(Submitted(claims[n], f"{100 + n}_0", str(100 + n), 0, str(tmp_path / "logs"))
                for n in range(num_jobs))
    return sweep_id, claims


def write_telemetry(run_dir: Path, rss_bytes: int) -> None:
    """Two CPU ranks sampled 12 times, as the memory sampler writes them; no summary.json."""
    tel = run_dir / "telemetry"
    (tel / "ranks").mkdir(parents=True)
    lines = [json.dumps({"t": 1000.0 + 5 * i, "node": "n1", "sample_s": 0.0001,
                         "ranks": [{"rank": r, "pid": 10 + r, "rss_bytes": rss_bytes + i, "shared_bytes": 0,
                                    "uss_bytes": None} for r in range(2)]}) for i in range(12)]
    (tel / "n1.jsonl").write_text("\n".join(lines) + "\n")


def table(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB "))
    rows = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line.split()
    return rows


def status_text(reg: Registry, target: str = "1") -> str:
    out = io.StringIO()
    assert cmd_status(reg, target, as_json=False, out=out) == 0
    return out.getvalue()


# ------------------------------------------------------------------------------------------------
# What an ended job left is read once


FLAGGED_MEMORY = {
    "mode": "gpu", "num_samples": 12, "duration_s": 60.0, "sample_cost_ms": {"mean": 0.1, "max": 0.3},
    "gpus": [{"node": "n1", "index": i, "total_bytes": 80 * GIB, "mean_util_pct": 90.0, "ranks": [i],
              "peak_used_bytes": (16 if i == 0 else 10) * GIB, "processes": []} for i in range(2)],
    "ranks": [], "nodes": [], "notes": [], "flags": ["GPU 0 on n1 peaked at 16.0 GiB"]}


@pytest.fixture
def ended_sweep(tmp_path: Path) -> Registry:
    """Job 0 COMPLETED with summary.json; job 1 FAILED with telemetry and no summary.json."""
    reg = Registry(tmp_path / "r.db")
    sweep_id, claims = slurm_sweep(reg, tmp_path, 2)
    for n in range(2):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "metrics.jsonl").write_text(
            json.dumps({"step": 10 + n, "train_loss": 0.5 + n}) + "\n")
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"memory": FLAGGED_MEMORY}))
    write_telemetry(tmp_path / "1", rss_bytes=3 * GIB)
    reg.observe([Observation(claims[0], "COMPLETED", exit_code=0, started_at=1.0, ended_at=9.0),
                 Observation(claims[1], "FAILED", exit_code=1, started_at=1.0, ended_at=9.0)])
    assert sweep_id == 1
    return reg


def test_an_ended_jobs_files_are_read_once_and_kept_in_the_registry(
        ended_sweep: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summarised: list[str] = []
    summarize = results.summarize

    def counted(run_dir: str, listing: Any = None) -> dict[str, Any]:
        summarised.append(str(run_dir))
        return summarize(run_dir, listing)

    monkeypatch.setattr(results, "summarize", counted)
    first = status_text(ended_sweep)
    assert summarised == [str(tmp_path / "1")]  # the failed job's telemetry, summarised once
    rows = table(first)
    assert rows["1/0"][6:10] == ["10/20", "0.5000", "16.00", "GiB"] and rows["1/0"][10] == "!1"
    assert rows["1/1"][6:10] == ["11/20", "1.5000", "3.00", "GiB"]
    assert "1/0: ! GPU 0 on n1 peaked at 16.0 GiB" in first
    for n in range(2):  # what is shown now comes from the registry, not from the files
        shutil.rmtree(tmp_path / str(n))
    assert status_text(ended_sweep) == first
    assert summarised == [str(tmp_path / "1")]
    out = io.StringIO()
    cmd_show(ended_sweep, "1/0", as_json=True, out=out)
    assert json.loads(out.getvalue())["memory"] == FLAGGED_MEMORY


def test_a_requeue_or_correction_drops_the_kept_result(ended_sweep: Registry, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct="true")  # SLURM knows nothing of these jobs yet
    status_text(ended_sweep)
    attempt = ended_sweep.latest_attempts(1)[0]
    (tmp_path / "0" / "metrics.jsonl").write_text(json.dumps({"step": 3, "train_loss": 2.0}) + "\n")
    assert table(status_text(ended_sweep))["1/0"][6] == "10/20"  # kept: the files are not read
    ended_sweep.observe([Observation(attempt.id, "RUNNING", requeues=1)])  # a new life
    assert table(status_text(ended_sweep))["1/0"][6:8] == ["3/20", "2.0000"]
    # A result read before the attempt changed is not kept for the changed attempt.
    ended_sweep.keep_results([(attempt, Result(99, 9.0, None, [], None))])
    assert attempt.id not in ended_sweep.results(1)


def test_status_decodes_each_job_row_once(ended_sweep: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    job = db._job

    def counted(row: sqlite3.Row) -> Job:
        decoded.append(row["num"])
        return job(row)

    monkeypatch.setattr(db, "_job", counted)
    status_text(ended_sweep)
    assert sorted(decoded) == [0, 1]


def test_an_ended_jobs_memory_from_one_listing_of_its_telemetry_is_what_a_full_look_finds(
        tmp_path: Path) -> None:
    """status lists a job's telemetry directory once instead of looking for each file (the end
    summary, the ranks' and peaks' directories): what it finds is the same."""
    run = tmp_path / "0"
    write_telemetry(run, rss_bytes=3 * GIB)
    for r in range(2):
        files.register_rank(run, r, r, "n1", None, environ={}, pid=10 + r)
    (run / "telemetry" / "peaks").mkdir()
    peak = {"rank": 1, "device": None, "max_rss_bytes": 4 * GIB, "uss_bytes": GIB}
    (run / "telemetry" / "peaks" / "rank-1.json").write_text(json.dumps(peak))
    memory = results.job_memory(str(run))
    assert memory == summarize(run)  # looked for file by file
    assert memory is not None and [(r["pid"], r["end"]) for r in memory["ranks"]] == [(10, None), (11, peak)]
    files.write_end_summary(run, {**memory, "notes": ["as rank 0 summarised it"]})
    assert results.job_memory(str(run)) == {**memory, "notes": ["as rank 0 summarised it"]}
    assert results.job_memory(str(tmp_path / "never-sampled")) is None


@pytest.fixture
def killed_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """Five jobs killed outright (FAILED, telemetry and no summary of it), job N at step 10 + N."""
    fake_slurm(tmp_path, monkeypatch, sacct="true")
    reg = Registry(tmp_path / "r.db")
    _, claims = slurm_sweep(reg, tmp_path, 5)
    for n in range(5):
        write_telemetry(tmp_path / str(n), rss_bytes=(n + 1) * GIB)
        metrics = json.dumps({"step": 10 + n, "train_loss": 1.0}) + "\n"
        (tmp_path / str(n) / "metrics.jsonl").write_text(metrics)
    reg.observe([Observation(claims[n], "FAILED", exit_code=1, started_at=1.0, ended_at=9.0)
                 for n in range(5)])
    return reg


def test_every_row_is_whole_on_the_first_call_however_slow_the_files_are(
        killed_sweep: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first status after 10,000 jobs were killed left up to 70 % of its rows `unread` (it read
    files for a second, then stopped): each ended job's files are now one small file to read
    (summary.json, rank 0's end summary or the sampler's kept fold), so every call reads every
    ended job, and no row is ever shown without its figures. Here reading a job takes 0.3 s (a
    loaded shared file system): the old call stopped reading after a second."""
    read_result = results.read_result

    def slow(run_dir: str) -> Result:
        time.sleep(0.3)
        return read_result(run_dir)

    monkeypatch.setattr(results, "read_result", slow)
    text = status_text(killed_sweep)
    rows = table(text)
    assert [rows[f"1/{n}"][6:10] for n in range(5)] == [
        [f"{10 + n}/20", "1.0000", f"{n + 1}.00", "GiB"] for n in range(5)]
    assert "unread" not in text and "not read yet" not in text
    assert sorted(killed_sweep.results(1)) == [1, 2, 3, 4, 5]  # kept: the next call reads no file
    out = io.StringIO()
    cmd_status(killed_sweep, "1", as_json=True, out=out)
    jobs = json.loads(out.getvalue())["jobs"]
    assert [j["step"] for j in jobs] == [10, 11, 12, 13, 14] and not any("unread" in j for j in jobs)


def test_read_all_is_still_taken(killed_sweep: Registry) -> None:
    """Every call reads every job now; scripts written with --read-all run on."""
    assert cli.main(["status", "1", "--read-all", "--registry", str(killed_sweep.path)]) == 0
    assert len(killed_sweep.results(1)) == 5


def test_one_jobs_status_reads_that_job_only(killed_sweep: Registry) -> None:
    rows = table(status_text(killed_sweep, "1/3"))
    assert list(rows) == ["1/3"] and rows["1/3"][6:10] == ["13/20", "1.0000", "4.00", "GiB"]
    assert rows["1/3"][-1] == "x=3"
    assert list(killed_sweep.results(1)) == [4]


# ------------------------------------------------------------------------------------------------
# Asking SLURM: only what is shown, matched in linear work, failures said


def test_show_asks_slurm_about_its_own_job_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_slurm(tmp_path, monkeypatch, sacct='tr "," "\\n" <<< "$ids" | sed "s/$/_0|RUNNING/"')
    with Registry(tmp_path / "r.db") as reg:
        slurm_sweep(reg, tmp_path, 3)
        cmd_show(reg, "1/1", as_json=False, out=io.StringIO())
        assert calls(log, "sacct") == ["101"]
        assert {n: a.state for n, a in reg.latest_attempts(1).items()} == {
            0: SUBMITTED, 1: "RUNNING", 2: SUBMITTED}


def _attempt(n: int, slurm_id: str) -> Attempt:
    return Attempt(n, 1, n, 1, slurm_id, slurm_id.split("_")[0], 0, SUBMITTED, 0, time.time(), None, None,
                   None, None, None, None, time.time())


def test_matching_the_sacct_reply_is_linear_in_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 tasks in 3 arrays: 7 and 8 have ended, 9 has a task still pending.
    reply = {f"{7 + n // 100}_{n % 100}": "PENDING" if n == 250 else "COMPLETED" for n in range(300)}
    attempts = [_attempt(n, task) for n, task in enumerate(reply)]
    monkeypatch.setattr(slurm_query, "_from_sacct", lambda ids, timeout_s: reply)
    looked_up: list[str] = []
    base_id = reconciliation.base_id

    def counted(job_id: str) -> str:
        looked_up.append(job_id)
        return base_id(job_id)

    monkeypatch.setattr(reconciliation, "base_id", counted)
    reported, settled, unanswered, warnings = reconciliation._slurm_reports(attempts, time.time(),
                                                                           slurm_query.query_states)
    assert reported == reply and unanswered == set() and warnings == []
    assert settled == {task for task in reply if not task.startswith("9_")}
    assert len(looked_up) <= 4 * (len(attempts) + len(reply))  # a scan per attempt would be 90,000


def test_a_failed_slurm_query_is_a_warning_and_changes_nothing(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch,
               sacct='echo "sacct: error: Problem talking to the database" >&2; exit 1',
               squeue='echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    with Registry(tmp_path / "r.db") as reg:
        slurm_sweep(reg, tmp_path, 2)
        # Old enough that SLURM's silence about them would mean they are gone, had SLURM answered.
        reg._db.execute("UPDATE attempts SET submitted_at = ?", (time.time() - 3600,))
        text = status_text(reg)
        assert "warning: SLURM did not answer, so 2 job(s) may show an old state" in text
        assert "Problem talking to the database" in text and "Unable to contact slurm controller" in text
        assert [row[1] for row in table(text).values()] == [SUBMITTED, SUBMITTED]
        out = io.StringIO()
        cmd_status(reg, "1", as_json=True, out=out)
        assert len(json.loads(out.getvalue())["warnings"]) == 1
        out = io.StringIO()
        cmd_show(reg, "1/0", as_json=False, out=out)
        assert "warning: SLURM did not answer, so 1 job(s)" in out.getvalue()


def test_a_queued_first_attempt_opens_no_files_and_a_queued_retry_shows_its_progress(
        ended_sweep: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct="true")
    status_text(ended_sweep)  # sweep 1's ended attempts: read once and kept
    read: list[str] = []
    read_result = results.read_result

    def counted(run_dir: str) -> Result:
        read.append(run_dir)
        return read_result(run_dir)

    monkeypatch.setattr(results, "read_result", counted)
    slurm_sweep(ended_sweep, tmp_path / "queued", 3)  # sweep 2: three first attempts, queued
    assert [r[1:3] for r in table(status_text(ended_sweep, "2")).values()] == [[SUBMITTED, "1"]] * 3
    assert read == []
    retry = ended_sweep.claim_retries(1)[1]  # job 1 failed: resubmitted, not started yet
    ended_sweep.confirm([Submitted(retry, "200_0", "200", 0, str(tmp_path / "logs"))])
    row = table(status_text(ended_sweep))["1/1"]
    assert row[1:3] == [SUBMITTED, "2"] and row[6] == "11/20"  # where the retry resumes from
    assert read == [str(tmp_path / "1")]


def test_a_running_jobs_memory_comes_from_its_samplers_fold_not_its_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """status reads what the sampler folded beside its samples (a day of samples was 0.2 s per job
    to parse): the raw file is not opened while the fold covers it, and a sample the fold missed
    (the sampler killed between its two writes) is read from the raw file's end."""
    fake_slurm(tmp_path, monkeypatch, sacct="true")
    reg = Registry(tmp_path / "r.db")
    _, claims = slurm_sweep(reg, tmp_path, 1)
    reg.observe([Observation(claims[0], "RUNNING", started_at=1.0)])
    write_telemetry(tmp_path / "0", rss_bytes=3 * GIB)
    raw = tmp_path / "0" / "telemetry" / "n1.jsonl"
    fold.NodeFold.resume(raw).write()  # what the sampler leaves after its samples
    with opened_samples() as opened:
        assert table(status_text(reg))["1/0"][8:10] == ["3.00", "GiB"]
    assert opened == []
    line = {"t": 2000.0, "node": "n1", "ranks": [{"rank": 0, "pid": 10, "rss_bytes": 5 * GIB}]}
    with open(raw, "a") as f:
        f.write(json.dumps(line) + "\n" + '{"t": 2005.0, "node": "n1", "ran')  # one being written
    assert table(status_text(reg))["1/0"][8:10] == ["5.00", "GiB"]
    reg.observe([Observation(claims[0], "COMPLETED", exit_code=0, ended_at=9.0)])
    status_text(reg)
    assert list(reg.results(1)) == [claims[0]]
