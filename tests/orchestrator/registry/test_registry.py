"""The sweep registry: its rules as unit tests, and its writers under real concurrency.

The concurrency tests start 100 real processes that wait on one barrier and then hit the same
SQLite file (or write their status files) at the same moment. They check the two failures that
matter: a lost update, and "database is locked".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch import slurm_query
from orchestrator.registry.db import Attempt, Job, Observation, Registry, Submitted
from orchestrator.registry.reconciliation import expand_array_states, infer, reconcile
from orchestrator.registry.states import SUBMIT_FAILED, SUBMITTED, SUBMITTING, accepts
from orchestrator.registry.status_file import TaskStatus

NUM_PROCS = 100
CTX = mp.get_context("fork")  # 100 processes start in well under a second


def _sweep(reg: Registry, tmp_path: Path, num_jobs: int, executor: str = "slurm") -> int:
    sweep_id = reg.create_sweep("app", "x=1,2", str(tmp_path), executor, str(tmp_path / "entry.pkl"))
    reg.add_jobs(Job(sweep_id, n, [f"x={n}"], str(tmp_path / str(n)), {"executor": executor}, 100)
                 for n in range(num_jobs))
    return sweep_id


def _attempt(state: str, **fields: Any) -> Attempt:
    values: dict[str, Any] = {
        "id": 1, "sweep_id": 1, "num": 0, "attempt": 1, "slurm_id": "7_0", "array_id": "7",
        "array_index": 0, "state": state, "requeues": 0, "submitted_at": 1000.0, "started_at": None,
        "ended_at": None, "exit_code": None, "node": None, "error": None, "log_dir": "/logs",
        "updated_at": 1000.0}
    values.update(fields)
    return Attempt(**values)


# ------------------------------------------------------------------------------------------------
# Rules


def test_a_job_is_claimed_submitted_and_observed(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 2)
        claims = reg.claim(sweep_id, [0, 1])
        assert {a.state for a in reg.attempts(sweep_id)} == {SUBMITTING}
        reg.confirm(Submitted(claims[n], f"7_{n}", "7", n, "/logs") for n in (0, 1))
        reg.observe([Observation(claims[0], "RUNNING", started_at=5.0, node="n1")])
        latest = reg.latest_attempts(sweep_id)
        assert (latest[0].state, latest[0].node, latest[0].started_at) == ("RUNNING", "n1", 5.0)
        assert latest[1].state == SUBMITTED and latest[1].slurm_id == "7_1"
        assert reg.find_attempt("7_1") == latest[1]


def test_an_end_is_never_undone_but_a_requeue_starts_a_new_life(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 1)
        attempt_id = reg.claim(sweep_id, [0])[0]
        reg.observe([Observation(attempt_id, "RUNNING")])
        reg.observe([Observation(attempt_id, "PENDING")])  # SLURM requeued it: back in the queue
        assert reg.latest_attempts(sweep_id)[0].state == "PENDING"
        reg.observe([Observation(attempt_id, "COMPLETED", exit_code=0)])
        assert reg.observe([Observation(attempt_id, "RUNNING")]) == 0  # a stale reconciler's view
        assert reg.latest_attempts(sweep_id)[0].state == "COMPLETED"
        reg.observe([Observation(attempt_id, "RUNNING", requeues=1)])  # a new life after a requeue
        latest = reg.latest_attempts(sweep_id)[0]
        assert (latest.state, latest.exit_code, latest.ended_at) == ("RUNNING", None, None)
    assert accepts("TIMEOUT", 0, "PENDING", 0)  # SLURM may requeue a timed-out job
    assert not accepts("FAILED", 0, "RUNNING", 0) and accepts("COMPLETED", 0, "FAILED", 0)
    assert not accepts("RUNNING", 2, "RUNNING", 1)


def test_a_cancelled_job_stays_cancelled_whatever_its_ranks_exit_with(tmp_path: Path) -> None:
    """``switchyard cancel`` records CANCELLED; the job's submitter, or a reconciler that read the
    job before, then sees its ranks end (0 after the SIGTERM, or SIGKILL after the grace) and
    records that end: it must not turn the cancel into COMPLETED or FAILED (a CI run read
    COMPLETED). A requeue still starts a new life."""
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 1)
        attempt_id = reg.claim(sweep_id, [0])[0]
        reg.observe([Observation(attempt_id, "RUNNING")])
        reg.observe([Observation(attempt_id, "CANCELLED", error="cancelled with switchyard cancel")])
        assert reg.observe([Observation(attempt_id, "COMPLETED", exit_code=0)]) == 0
        assert reg.observe([Observation(attempt_id, "FAILED", exit_code=137)]) == 0
        latest = reg.latest_attempts(sweep_id)[0]
        assert (latest.state, latest.exit_code, latest.error) == (
            "CANCELLED", None, "cancelled with switchyard cancel")
        assert reg.observe([Observation(attempt_id, "PENDING", requeues=1)]) == 1
    assert accepts("COMPLETED", 0, "CANCELLED", 0) and accepts("FAILED", 0, "CANCELLED", 0)


def test_only_failed_timed_out_and_cancelled_jobs_are_claimed_for_a_retry(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 5)
        claims = reg.claim(sweep_id, range(5))
        for num, state in enumerate(["COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "RUNNING"]):
            reg.observe([Observation(claims[num], state)])
        retries = reg.claim_retries(sweep_id)
        assert sorted(retries) == [1, 2, 3]
        assert [a.attempt for a in reg.attempts(sweep_id, 1)] == [1, 2]
        assert reg.claim_retries(sweep_id) == {}  # the new attempts are in flight


def test_unknown_sweep_and_job_errors_say_what_exists(tmp_path: Path) -> None:
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 1)
        with pytest.raises(Exception, match=r"no sweep 99 .*latest: \[1\]"):
            reg.sweep(99)
        with pytest.raises(Exception, match=f"sweep {sweep_id} has no job 5"):
            reg.job(sweep_id, 5)


def test_folded_array_entries_expand_and_single_lines_win() -> None:
    states = expand_array_states({"27_[2-4,7%2]": "PENDING", "27_3": "RUNNING", "27_0": "COMPLETED",
                                  "28": "FAILED"})
    assert states == {"27_2": "PENDING", "27_3": "RUNNING", "27_4": "PENDING", "27_7": "PENDING",
                      "27_0": "COMPLETED", "28": "FAILED"}


def test_infer_prefers_slurm_terminal_states_then_the_tasks_own_report() -> None:
    started = TaskStatus("7_0", started_at=10.0, node="n1")
    ended_ok = TaskStatus("7_0", started_at=10.0, node="n1", ended_at=12.0, exit_code=0)
    ended_bad = TaskStatus("7_0", started_at=10.0, ended_at=12.0, exit_code=1, error="ValueError: x")
    now = 2000.0

    def state(reported: str | None, status: TaskStatus | None, settled: bool = False,
              attempt: Attempt | None = None) -> str | None:
        seen = infer(attempt or _attempt(SUBMITTED), reported, status, settled, now)
        return seen.state if seen else None

    assert state("FAILED", ended_ok) == "FAILED"  # another rank failed the job after rank 0 ended
    assert state("RUNNING", ended_ok) == "COMPLETING"  # sacct lags the end by a few seconds
    assert state("COMPLETING", ended_bad) == "COMPLETING"  # ...and SLURM has the last word
    assert state(None, ended_ok) == "COMPLETED" and state(None, ended_bad) == "FAILED"
    assert state("REQUEUED", ended_ok) == "REQUEUED"  # that end was a previous life's
    assert state("PENDING", None) == "PENDING"
    assert state(None, started) == "RUNNING"  # sacct has not caught up with the start yet
    assert state(None, None) is None  # nothing known: keep what the registry has
    assert state(None, None, settled=True) == "CANCELLED"  # cancelled while pending: gone from sacct
    assert state(None, started, settled=True) == "FAILED"  # died without writing its end
    assert state(None, None, attempt=_attempt(SUBMITTING, submitted_at=0.0)) == SUBMIT_FAILED
    seen = infer(_attempt(SUBMITTED), "COMPLETED", started, False, now)
    assert seen is not None and (seen.exit_code, seen.node, seen.started_at) == (0, "n1", 10.0)


def test_a_failed_job_whose_every_rank_stopped_cleanly_is_recorded_as_a_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``scancel --signal=TERM`` signals the ranks only: each checkpoints, leaves its stop file and
    exits, and SLURM says FAILED. It was recorded FAILED, no exit, no error; it is the stop
    ``switchyard cancel`` records as CANCELLED. A rank without its stop file keeps it FAILED."""
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = _sweep(reg, tmp_path, 2)
        claims = reg.claim(sweep_id, [0, 1])
        logs = tmp_path / "logs"
        reg.confirm([Submitted(claims[n], f"7_{n}", "7", n, str(logs)) for n in (0, 1)])
        logs.mkdir()
        for n in (0, 1):
            for rank in (0, 1):
                (logs / f"7_{n}_{rank}_log.out").write_text("training\n")
            (logs / f"7_{n}_0_log.out").write_text(f"stopped by PREEMPTED at step {40 + n}; checkpoint in C")
            (logs / f"7_{n}_0_result.stopped").write_text("PREEMPTED")
        (logs / "7_0_1_result.stopped").write_text("PREEMPTED")  # job 1's rank 1 left none: it failed
        reply = slurm_query.StatesReply({"7_0": "FAILED", "7_1": "FAILED"}, frozenset({"7"}), ())
        reconcile(reg, [sweep_id], ask_slurm=lambda ids: reply)
        stopped, failed = (reg.attempts(sweep_id, n)[-1] for n in (0, 1))
    assert (stopped.state, stopped.exit_code) == ("CANCELLED", 143)
    assert stopped.error == ("stopped on a signal to its ranks (scancel --signal, or preemption): stopped by "
                             "PREEMPTED at step 40; checkpoint in C")
    assert (failed.state, failed.error) == ("FAILED", None)


# ------------------------------------------------------------------------------------------------
# Real concurrency: 100 processes at the same moment


def _run_together(target: Callable[..., None], args_for: Callable[[int], tuple[Any, ...]],
                  tmp_path: Path, n: int = NUM_PROCS) -> list[str]:
    """Start n processes that each wait on one barrier, then run target; returns their errors."""
    barrier, errors = CTX.Barrier(n), CTX.Queue()
    procs = [CTX.Process(target=_guarded, args=(target, barrier, errors, *args_for(i))) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert all(p.exitcode == 0 for p in procs), found
    return found


def _guarded(target: Callable[..., None], barrier: Any, errors: Any, *args: Any) -> None:
    try:
        barrier.wait(timeout=120)
        target(*args)
    except Exception:
        errors.put(traceback.format_exc())
        raise


def _open_and_claim(path: str, sweep_id: int) -> None:
    with Registry(path) as reg:
        reg.claim(sweep_id, [0])


def test_a_hundred_processes_claiming_the_same_job_lose_no_update(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Registry(path) as reg:
        sweep_id = _sweep(reg, tmp_path, 1)
    errors = _run_together(_open_and_claim, lambda i: (str(path), sweep_id), tmp_path)
    assert errors == []
    with Registry(path) as reg:
        # attempt = MAX + 1 computed inside each writer's transaction: 1..100, none twice
        assert sorted(a.attempt for a in reg.attempts(sweep_id, 0)) == list(range(1, NUM_PROCS + 1))


def _create_sweep(path: str, tmp: str) -> None:
    with Registry(path) as reg:
        sweep_id = reg.create_sweep("app", "", tmp, "slurm", "entry")
        reg.add_jobs([Job(sweep_id, 0, [], tmp, {}, None)])
        reg.claim(sweep_id, [0])


def test_a_hundred_processes_creating_a_new_registry_at_once_all_succeed(tmp_path: Path) -> None:
    path = tmp_path / "new" / "r.db"  # does not exist: schema creation and WAL switch race too
    errors = _run_together(_create_sweep, lambda i: (str(path), str(tmp_path)), tmp_path)
    assert errors == []
    with Registry(path) as reg:
        assert sorted(s.id for s in reg.sweeps()) == list(range(1, NUM_PROCS + 1))
        assert reg._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _resubmit_failed(path: str, sweep_id: int) -> None:
    with Registry(path) as reg:
        reg.claim_retries(sweep_id)


def test_a_hundred_racing_resubmits_claim_each_failed_job_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Registry(path) as reg:
        sweep_id = _sweep(reg, tmp_path, 10)
        claims = reg.claim(sweep_id, range(10))
        reg.observe(Observation(claims[n], "FAILED" if n % 2 else "COMPLETED") for n in range(10))
    assert _run_together(_resubmit_failed, lambda i: (str(path), sweep_id), tmp_path) == []
    with Registry(path) as reg:
        counts = {n: len(reg.attempts(sweep_id, n)) for n in range(10)}
    assert counts == {n: 2 if n % 2 else 1 for n in range(10)}


def _task_ends(run_dir: str, job_id: str) -> None:
    """An array task's last act: its end report (it never opens the database)."""
    TaskStatus(job_id, started_at=time.time(), node="n1").write(run_dir)
    TaskStatus(job_id, started_at=time.time(), node="n1", ended_at=time.time(), exit_code=0).write(run_dir)


def _reconcile(path: str, sweep_id: int) -> None:
    with Registry(path) as reg:
        for _ in range(5):
            reconcile(reg, [sweep_id], ask_slurm=slurm_query.query_states)


def test_a_hundred_tasks_ending_at_once_while_four_reconcilers_run_are_all_recorded(
        tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Registry(path) as reg:
        sweep_id = _sweep(reg, tmp_path, NUM_PROCS, executor="local")
        claims = reg.claim(sweep_id, range(NUM_PROCS))
    barrier = CTX.Barrier(NUM_PROCS + 4)
    errors = CTX.Queue()
    # Local jobs are named by pid: each task process's own pid is its job id.
    tasks = [CTX.Process(target=_guarded_task, args=(barrier, errors, str(tmp_path / str(n))))
             for n in range(NUM_PROCS)]
    for t in tasks:
        t.start()
    with Registry(path) as reg:
        reg.confirm(Submitted(claims[n], str(t.pid), None, None, str(tmp_path)) for n, t in enumerate(tasks))
    reconcilers = [CTX.Process(target=_guarded, args=(_reconcile, barrier, errors, str(path), sweep_id))
                   for _ in range(4)]
    for r in reconcilers:
        r.start()
    for p in [*tasks, *reconcilers]:
        p.join(timeout=180)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == [] and all(p.exitcode == 0 for p in [*tasks, *reconcilers])
    with Registry(path) as reg:
        reconcile(reg, [sweep_id], ask_slurm=slurm_query.query_states)
        latest = reg.latest_attempts(sweep_id)
    assert {a.state for a in latest.values()} == {"COMPLETED"}
    assert all(a.exit_code == 0 and a.node == "n1" and a.ended_at for a in latest.values())


def _guarded_task(barrier: Any, errors: Any, run_dir: str) -> None:
    _guarded(_task_ends, barrier, errors, run_dir, str(os.getpid()))
