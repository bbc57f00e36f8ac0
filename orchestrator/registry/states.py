"""The state vocabulary of an attempt: SLURM's own state names, the two before SLURM knows the
job, which of them are final, and which may move to which (:func:`accepts`)."""

from __future__ import annotations

# Attempt states: SLURM's own names, plus the two before SLURM knows the job.
SUBMITTING = "SUBMITTING"  # claimed in the registry, sbatch not answered yet
SUBMITTED = "SUBMITTED"  # sbatch answered; SLURM has not reported on it yet
SUBMIT_FAILED = "SUBMIT_FAILED"  # sbatch refused it
# A search's trial its pruner stopped (orchestrator/search): cancelled as `switchyard cancel` does
# it, checkpoint kept, but told apart from a user's cancel and never resubmitted by `--failed`.
PRUNED = "PRUNED"
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", SUBMIT_FAILED, PRUNED})
# Ends set by a command rather than seen: what SLURM or the processes say afterwards cannot move them.
STOPPED_STATES = frozenset({"CANCELLED", PRUNED})
# Terminal for now, but SLURM or the job itself may requeue it: keep asking for a day.
REQUEUABLE_STATES = frozenset({"TIMEOUT", "PREEMPTED", "NODE_FAIL"})
TERMINAL_STATES = FINAL_STATES | REQUEUABLE_STATES
RECHECK_REQUEUABLE_S = 24 * 3600.0
# What `resubmit --failed` reruns.
RETRY_STATES = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                          "BOOT_FAIL", "DEADLINE", SUBMIT_FAILED})
QUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"})


def accepts(old_state: str, old_requeues: int, new_state: str, new_requeues: int) -> bool:
    """May an attempt recorded in ``old_state`` be moved to ``new_state``?

    A requeue (a higher restart count) starts a new life. Within one life, a final state
    (COMPLETED, FAILED, ...) only gives way to another final one (SLURM correcting a task's own
    report); anything else may change freely: a running job goes back to PENDING when SLURM
    requeues it, and a TIMEOUT or PREEMPTED job may be requeued too. A stale live state written by
    a slower reconciler is corrected by the next one; a stale end would never be, so ends win.

    CANCELLED (and PRUNED, a search's cancel) stays, as SLURM keeps a cancelled job CANCELLED
    whatever its processes exit with:
    a local job's ranks that leave on the cancel's SIGTERM with status 0 (or are killed at the
    end of its grace) are seen ending by its submitter and by any reconciler, and whichever wrote
    last used to win, so a cancelled job could read COMPLETED or FAILED.
    """
    if new_requeues != old_requeues:
        return new_requeues > old_requeues
    if old_state in STOPPED_STATES:
        return new_state == old_state
    return old_state not in FINAL_STATES or new_state in FINAL_STATES


def stopped_state(reported: str) -> str:
    """The state of an attempt whose every rank left cleanly on a stop request, given SLURM's:
    where only the ranks were signalled (``scancel --signal=TERM``), SLURM saw them exit non-zero
    and says FAILED; it is a stop, recorded CANCELLED as ``switchyard cancel`` records the same."""
    return "CANCELLED" if reported == "FAILED" else reported
