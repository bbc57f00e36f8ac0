"""Cancelling a recorded job, the one way: ``switchyard cancel`` (sweeps and single jobs) and the
function API's ``Job.cancel()`` share its check, so a job that has ended stays as it ended."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.launch import local_jobs, slurm_query
from orchestrator.registry.db import Attempt, Observation, Registry
from orchestrator.registry.reconciliation import reconcile
from orchestrator.registry.states import TERMINAL_STATES
from orchestrator.registry.status_file import where_stopped


class CancelError(RuntimeError):
    """SLURM refused the cancel; the message quotes it."""


def has_ended(attempt: Attempt) -> bool:
    """Whether cancelling the attempt would change what it did: not once it ended, nor once its
    rank 0 reported its end while SLURM still completes it (COMPLETING): ``scancel`` then turns a
    job that finished into CANCELLED+ in sacct, and the registry follows SLURM."""
    ended_itself = attempt.state == "COMPLETING" and attempt.ended_at is not None
    return attempt.state in TERMINAL_STATES or ended_itself


@dataclass(frozen=True)
class Cancelled:
    """What a cancel did: the attempts it stopped (now CANCELLED in the registry), the SLURM ids
    still ending, and, for local jobs whose controller had died, how many of their processes
    (ranks, and what they started) it found still running and stopped, by job id."""

    attempts: list[Attempt]
    ending: list[str]
    leftovers: dict[str, int] = field(default_factory=dict)


def cancel(registry: Registry, sweep_id: int, num: int | None, grace_s: float, by: str,
           state: str = "CANCELLED") -> Cancelled:
    """Stop the live attempts of a sweep (or of its job ``num``): the one check and the one way
    that ``switchyard cancel`` and the function API's ``Job.cancel()`` share. An attempt that has
    ended (``has_ended``) is left as it is, so a finished job stays COMPLETED; but a local job's
    ranks left running after their controller died (killed outright) are stopped whatever the
    registry says: the job has ended, they have not. ``state``: what the stopped attempts become
    in the registry (CANCELLED, or a search's PRUNED)."""
    for warning in reconcile(registry, [sweep_id], ask_slurm=slurm_query.query_states).warnings:
        print(f"warning: {warning}", file=sys.stderr)
    executor = registry.sweep(sweep_id).executor
    latest = [a for a in registry.latest_attempts(sweep_id).values()
              if (num is None or a.num == num) and a.slurm_id]
    live = [a for a in latest if not has_ended(a)]
    cancelled = _cancel_slurm(live) if executor == "slurm" else _cancel_local(live, grace_s)
    ending = _wait_slurm_ended([str(a.slurm_id) for a in cancelled]) if executor == "slurm" else []
    leftovers = _stop_leftovers(latest, grace_s) if executor == "local" else {}
    cancelled += [a for a in live if str(a.slurm_id) in leftovers and a not in cancelled]
    now = time.time()
    registry.observe(Observation(a.id, state, requeues=a.requeues, ended_at=now,
                                 error=f"{state.lower()} by {by}{_where(a)}" if state != "CANCELLED"
                                 else f"cancelled with {by}{_where(a)}") for a in cancelled)
    return Cancelled(cancelled, ending, leftovers)


def _stop_leftovers(attempts: list[Attempt], grace_s: float) -> dict[str, int]:
    """job id -> how many of its processes were left running after its controller died, now stopped."""
    stopped = {}
    for attempt in attempts:
        found = local_jobs.leftover_ranks(int(str(attempt.slurm_id)),
                                          Path(attempt.log_dir) if attempt.log_dir else None)
        if found:
            stopped[str(attempt.slurm_id)] = local_jobs.stop_leftovers(found, grace_s)
    return stopped


def _where(attempt: Attempt) -> str:
    """``: stopped by PREEMPTED at step 676; checkpoint in DIR`` where its rank 0 said so."""
    said = where_stopped(attempt.log_dir, str(attempt.slurm_id)) if attempt.log_dir else None
    return f": {said}" if said else ""


def _cancel_slurm(attempts: list[Attempt]) -> list[Attempt]:
    if not attempts:
        return []
    proc = subprocess.run(["scancel", *[str(a.slurm_id) for a in attempts]], capture_output=True,
                          text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise CancelError(f"scancel failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return attempts


# States of a job whose ranks are still at work: a cancelled job is COMPLETING in the controller
# while its ranks handle SIGTERM (a checkpoint being written), until they exit or KillWait ends.
STILL_ENDING = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "SIGNALING", "STAGE_OUT"})
# How long `cancel` waits for them: SLURM's KillWait (30 s by default) and a margin to clean up.
SLURM_END_WAIT_S = 120.0


def _wait_slurm_ended(slurm_ids: list[str], poll_s: float = 0.5) -> list[str]:
    """Wait until the controller no longer lists any of the cancelled jobs as still ending, saying
    so on stderr while it waits; returns those still ending after ``SLURM_END_WAIT_S``. scancel
    returns at once, while the ranks may still be writing their checkpoint."""
    deadline = time.monotonic() + SLURM_END_WAIT_S
    told = False
    while True:
        try:
            states = slurm_query.controller_states(slurm_ids)
        except slurm_query.SlurmQueryError as e:
            print(f"warning: cannot tell whether the cancelled jobs have ended: squeue: {e}", file=sys.stderr)
            return []
        ending = [i for i in slurm_ids if states.get(i) in STILL_ENDING]
        if not ending or time.monotonic() >= deadline:
            return ending
        if not told:
            told = True
            print(f"waiting for job(s) {', '.join(ending)} to end: SLURM sent their ranks SIGTERM, and "
                  f"they may be writing a checkpoint ({states[ending[0]]})", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def _cancel_local(attempts: list[Attempt], grace_s: float) -> list[Attempt]:
    pids = {int(str(a.slurm_id)): a for a in attempts}
    return [pids[pid] for pid in local_jobs.terminate(list(pids), grace_s)]
