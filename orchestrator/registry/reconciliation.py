"""Reconciliation: one batched SLURM query + the tasks' status files -> one transaction."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrator.registry.db import Attempt, Observation, Registry
from orchestrator.registry.states import (
    QUEUED_STATES,
    SUBMIT_FAILED,
    SUBMITTING,
    TERMINAL_STATES,
    stopped_state,
)
from orchestrator.registry.status_file import TaskStatus, stopped_cleanly


class StatesReply(Protocol):
    """What SLURM said about a list of job ids (``launch.slurm_query.StatesReply``)."""

    @property
    def states(self) -> dict[str, str]: ...  # {job id: STATE}; ids SLURM does not know are left out
    @property
    def answered(self) -> AbstractSet[str]: ...  # the asked ids SLURM answered for (known or not)
    @property
    def errors(self) -> Sequence[str]: ...  # one line per part of the query that got no answer


# Asks SLURM about these job ids in one batch. Given by the caller: the registry sits below launch/,
# which holds the commands that ask (launch.slurm_query.query_states).
AskSlurm = Callable[[list[str]], StatesReply]

STOPPED_EXIT = 143  # 128 + SIGTERM: what a job's launcher exits with once its ranks stopped cleanly
STALE_CLAIM_S = 600.0  # a SUBMITTING claim this old: its submitter died before sbatch answered
SILENT_AFTER_S = 300.0  # SLURM (sacct and squeue) silent about a job this old: it is long gone
_ARRAY_TASK = re.compile(r"^(\d+)_(\d+)$")
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([\d,\-]+)(?:%\d+)?\]$")  # pending tasks, folded: 27_[2-5,7%2]


def expand_array_states(states: dict[str, str]) -> dict[str, str]:
    """``{"27_[2-3%1]": "PENDING", "27_0": "RUNNING"}`` -> one entry per task id.

    sacct and squeue fold an array's not-yet-started tasks into one bracketed entry; a task
    listed on its own line wins over the folded range.
    """
    out: dict[str, str] = {}
    for key, state in states.items():
        match = _ARRAY_RANGE.match(key)
        if match is None:
            continue
        for part in match.group(2).split(","):
            lo, _, hi = part.partition("-")
            for index in range(int(lo), int(hi or lo) + 1):
                out[f"{match.group(1)}_{index}"] = state
    out.update({k: v for k, v in states.items() if _ARRAY_RANGE.match(k) is None})
    return out


def base_id(slurm_id: str) -> str:
    """The id SLURM is asked about: the array's for an array task, else the job's own."""
    return slurm_id.split("_", 1)[0]



def infer(attempt: Attempt, reported: str | None, status: TaskStatus | None, settled: bool,
          now: float, stopped: str | None = None) -> Observation | None:
    """What an attempt's state is now, from what SLURM (or the local process table) reported,
    what the task wrote, and whether its array has finished entirely; None when nothing is known.

    SLURM's terminal states win (a rank other than 0 can fail the job). A task's own end report
    makes the attempt COMPLETING while SLURM still calls it live (sacct lags the end by seconds,
    and a job requeued while it finished will run again), and ends it only when SLURM has no
    record to contradict it. Back in the queue, the report is a previous life's and is set aside.

    ``stopped``: where the attempt stopped, when every rank left on a stop request
    (``status_file.stopped_cleanly``). SLURM calls such a job FAILED when only its ranks were
    signalled (``scancel --signal=TERM``): it saw them exit non-zero, not a cancel. It is recorded
    CANCELLED, as ``switchyard cancel`` records the same stop, saying where it stopped.
    """
    fields: dict[str, Any] = {}
    if status is not None:
        fields = {"requeues": status.restarts, "started_at": status.started_at, "node": status.node,
                  "ended_at": status.ended_at, "exit_code": status.exit_code, "error": status.error}
    ended = status is not None and status.ended_at is not None
    if reported == "FAILED" and stopped is not None:
        state = stopped_state(reported)
        fields.update(ended_at=fields.get("ended_at") or now,
                      exit_code=fields.get("exit_code") or STOPPED_EXIT,
                      error=f"stopped on a signal to its ranks (scancel --signal, or preemption): {stopped}")
    elif reported in TERMINAL_STATES:
        state = str(reported)
        if state == "COMPLETED" and fields.get("exit_code") is None:
            fields["exit_code"] = 0
    elif reported in QUEUED_STATES:
        state = str(reported)
        fields = {k: v for k, v in fields.items() if k not in ("ended_at", "exit_code", "error")}
    elif ended and status is not None:
        state = "COMPLETING" if reported is not None else \
            "COMPLETED" if status.exit_code == 0 else "FAILED"
    elif reported is not None:
        state = reported
    elif settled:
        state = "FAILED" if status is not None else "CANCELLED"
        fields["error"] = ("ended without a status report (killed, or its node failed)"
                           if status is not None else "never started (cancelled while pending)")
        fields["ended_at"] = fields.get("ended_at") or now
    elif status is not None:
        state = "RUNNING"
    elif attempt.state == SUBMITTING and now - attempt.submitted_at > STALE_CLAIM_S:
        return Observation(attempt.id, SUBMIT_FAILED, error="the submitting process stopped "
                           "before sbatch answered")
    else:
        return None
    return Observation(attempt.id, state, **{k: v for k, v in fields.items() if v is not None})


def _slurm_reports(attempts: Sequence[Attempt], now: float, ask_slurm: AskSlurm
                   ) -> tuple[dict[str, str], set[str], set[str], list[str]]:
    """One batched query for every array: (state per task id, ids whose array has settled, ids
    SLURM did not answer for, one warning per part of the query that failed)."""
    bases = sorted({base_id(a.slurm_id) for a in attempts if a.slurm_id})
    if not bases:
        return {}, set(), set(), []
    reply = ask_slurm(bases)
    reported = expand_array_states(reply.states)
    # The reply indexed once by array: each attempt then looks up its own (was a scan per attempt).
    by_array: dict[str, list[str]] = {}
    for task, state in reported.items():
        by_array.setdefault(base_id(task), []).append(state)
    array_ended = {base: all(s in TERMINAL_STATES for s in states) for base, states in by_array.items()}
    settled, unanswered = set(), set()
    for a in attempts:
        if not a.slurm_id:
            continue
        base = base_id(a.slurm_id)
        if base not in reply.answered:
            unanswered.add(a.slurm_id)  # silence here is not SLURM's: conclude nothing from it
        elif array_ended.get(base, False) or \
                (base not in by_array and now - a.submitted_at > SILENT_AFTER_S):
            settled.add(a.slurm_id)
    warnings = [f"SLURM did not answer, so {len(unanswered)} job(s) may show an old state "
                f"({error})" for error in reply.errors[:3]]
    return reported, settled, unanswered, warnings


def _local_reports(attempts: Sequence[Attempt]) -> tuple[dict[str, str], set[str]]:
    """Local jobs have no queue: the submitit controller's pid is alive (running) or not."""
    reported, settled = {}, set()
    for a in attempts:
        if not a.slurm_id:
            continue
        if _pid_alive(int(a.slurm_id)):
            reported[a.slurm_id] = "RUNNING"
        else:
            settled.add(a.slurm_id)
    return reported, settled


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that ended, not yet reaped) is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@dataclass(frozen=True)
class Reconciled:
    changed: int  # attempts whose record changed
    warnings: list[str]  # what could not be asked (a failed sacct): the user must see it


def reconcile(registry: Registry, sweep_ids: Sequence[int] | None = None,
              nums: Sequence[int] | None = None, *, ask_slurm: AskSlurm) -> Reconciled:
    """Bring every unsettled attempt of these sweeps (all when None), or of these jobs of them,
    up to date; SLURM's jobs are asked about through ``ask_slurm`` (``launch.slurm_query.query_states``)."""
    now = time.time()
    unsettled = registry.unsettled(sweep_ids, nums)
    slurm = [u.attempt for u in unsettled if u.executor == "slurm"]
    local = [u.attempt for u in unsettled if u.executor != "slurm"]
    # Ask SLURM (or the process table) first, read the status files after: a task that ended in
    # between then shows its end report, never "gone without one".
    reported, settled, unanswered, warnings = _slurm_reports(slurm, now, ask_slurm)
    local_reported, local_settled = _local_reports(local)
    reported.update(local_reported)
    settled |= local_settled
    observations = []
    for u in unsettled:
        a = u.attempt
        if a.slurm_id in unanswered:
            continue  # left as recorded until SLURM answers; the warning says so
        status = TaskStatus.read(u.run_dir, a.slurm_id) if a.slurm_id else None
        said = reported.get(a.slurm_id or "")
        # only where SLURM says FAILED: one listing of its log folder, once (the end is final)
        stopped = stopped_cleanly(a.log_dir, a.slurm_id) if said == "FAILED" and a.slurm_id else None
        seen = infer(a, said, status, (a.slurm_id or "") in settled, now, stopped)
        if seen is not None:
            observations.append(seen)
    return Reconciled(registry.observe(observations) if observations else 0, warnings)
