"""Read job states from SLURM in one batched call: ``sacct`` first, ``squeue`` when accounting is off.

Batched on purpose: one process per poll, whatever the number of jobs (submitit polls sacct the
same way; the sweep registry reconciles hundreds of array tasks through here).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                             "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


class SlurmQueryError(RuntimeError):
    """Neither sacct nor squeue answered."""


def job_states(job_ids: Iterable[str], timeout_s: float = 30) -> dict[str, str]:
    """``{job_id: STATE}`` for the given ids (array tasks as ``ARRAY_TASK``); unknown ids are left out."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    try:
        return _from_sacct(ids, timeout_s)
    except (subprocess.SubprocessError, OSError):
        return _from_squeue(ids, timeout_s)


def _from_sacct(ids: list[str], timeout_s: float) -> dict[str, str]:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ids)],
                         capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    states = {}
    for line in out.splitlines():
        job_id, _, state = line.partition("|")
        if job_id:
            states[job_id] = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    return states


def _from_squeue(ids: list[str], timeout_s: float) -> dict[str, str]:
    try:
        proc = subprocess.run(["squeue", "-h", "-o", "%i|%T", "-j", ",".join(ids)],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(f"neither sacct nor squeue answered: {e}") from e
    return {job_id: state for job_id, _, state in
            (line.partition("|") for line in proc.stdout.splitlines()) if job_id}


def wait_for_terminal_states(job_ids: Iterable[str], timeout_s: float = 60,
                             poll_s: float = 0.5) -> dict[str, str]:
    """Poll until every job is in a terminal state (results can exist before SLURM records the end)."""
    ids = set(job_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        states = job_states(ids)
        if all(states.get(i) in TERMINAL_STATES for i in ids) or time.monotonic() > deadline:
            return states
        time.sleep(poll_s)
