"""Restarts inside the allocation: ``cluster.restarts=N`` starts the ranks again in the same SLURM
job, from the newest checkpoint, instead of sending it back to the queue.

A 512-GPU job that loses one rank to a transient NCCL error, a killed process or a node that
stopped answering would otherwise wait hours to start again, while its allocation is still there.
The batch script runs the job step (``srun``) in a loop (:func:`wrap`): when the step fails, it
starts it again, up to N times, with ``SWITCHYARD_RESTART`` counting the restarts. Each start is a
new rendezvous (the ranks' endpoint files are keyed on the requeue count and the restart,
``DistEnv.attempt``), and every rank resumes from the run's newest checkpoint, as a requeue does.

It stops restarting, and the job fails as it would have without restarts, when:
- the step ends because a stop was asked (a rank left a ``.stopped`` file: preemption, a cancel,
  the time limit's requeue): the stop is not a failure;
- the same failure came twice in a row: each rank whose own code raised (not a lost peer, not a
  collective timeout, which are consequences or transient) writes its step and error line into
  the attempt's folder (:func:`record_failure`); two attempts in a row whose folders hold the same
  lines failed the same way at the same step, which is the user's code, not the machine;
- N restarts are used up.

The loop is plain shell (``cmp``, ``find``, ``date``): it runs on the batch node, outside any
container, where the submitting machine's Python may not exist.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

RESTART_ENV = "SWITCHYARD_RESTART"  # 0 on the first start inside the allocation
ATTEMPT_DIR_ENV = "SWITCHYARD_ATTEMPT_DIR"  # where this start's failures are recorded
FAILED_AT = "failed_at"  # in an attempt's folder: when its step ended, for the restart's delay
DIR = "restarts"  # RUN/submitit/restarts/JOB-REQUEUES-RESTART/


def wrap(script: str, restarts: int, folder: Path) -> str:
    """The batch script with its ``srun`` line in the restart loop (unchanged when ``restarts`` is 0)."""
    if restarts <= 0:
        return script
    lines = script.rstrip("\n").split("\n")
    at = max(i for i, line in enumerate(lines) if line.startswith("srun "))
    return "\n".join([*lines[:at], *loop(lines[at], restarts, folder), *lines[at + 1:]]) + "\n"


# The loop around the job step; @...@ are filled in by ``loop``. Plain shell: see the docstring.
LOOP = r"""# up to @N@ restarts inside this allocation (cluster.restarts): orchestrator/launch/restarts.py
sy_job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
sy_job=${sy_job:-$SLURM_JOB_ID}
sy_base=@BASE@/$sy_job-${SLURM_RESTART_COUNT:-0}
for SWITCHYARD_RESTART in $(seq 0 @N@); do
    export SWITCHYARD_RESTART SWITCHYARD_ATTEMPT_DIR=$sy_base-$SWITCHYARD_RESTART
    mkdir -p "$SWITCHYARD_ATTEMPT_DIR" && touch "$SWITCHYARD_ATTEMPT_DIR/.started"
    @SRUN@
    sy_rc=$?
    date +%s.%N > "$SWITCHYARD_ATTEMPT_DIR/failed_at"
    [ "$sy_rc" -eq 0 ] && break
    if [ -n "$(find @FOLDER@ -maxdepth 1 -name "${sy_job}_*.stopped" \
               -newer "$SWITCHYARD_ATTEMPT_DIR/.started" 2>/dev/null)" ]; then
        break  # a stop was asked (preemption, a cancel, the time limit's requeue): not a failure
    fi
    if [ "$SWITCHYARD_RESTART" -ge @N@ ]; then
        echo "switchyard: the step failed (exit $sy_rc) and its @N@ restart(s) inside the allocation" \
             "are used up (cluster.restarts=@N@)" >&2
        break
    fi
    sy_previous=$sy_base-$(( SWITCHYARD_RESTART - 1 ))
    if [ "$SWITCHYARD_RESTART" -gt 0 ] && ls "$SWITCHYARD_ATTEMPT_DIR" | grep -q '^rank-' \
       && diff -q -r -x failed_at -x .started "$sy_previous" "$SWITCHYARD_ATTEMPT_DIR" > /dev/null; then
        echo "switchyard: the same failure twice in a row (the same ranks, step and error): it is" \
             "the code's, not the machine's; not restarting" >&2
        break
    fi
    echo "switchyard: the step failed (exit $sy_rc); restart $(( SWITCHYARD_RESTART + 1 ))/@N@" \
         "inside allocation $sy_job, from the run's newest checkpoint (or its start, without one)" >&2
done
exit "$sy_rc"
"""


def loop(srun: str, restarts: int, folder: Path) -> list[str]:
    text = (LOOP.replace("@N@", str(restarts)).replace("@BASE@", shlex.quote(str(folder / DIR)))
            .replace("@FOLDER@", shlex.quote(str(folder))).replace("@SRUN@", srun))
    return text.rstrip("\n").split("\n")


def record_failure(rank: int, step: int, error: BaseException, consequence: bool) -> None:
    """A rank of a job with restarts whose own code raised: its step and error line, for the batch
    script's "the same failure twice" (``consequence``: a lost peer or a collective timeout, not
    recorded)."""
    folder = os.environ.get(ATTEMPT_DIR_ENV)
    if not folder or consequence:
        return
    line = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    with contextlib.suppress(OSError):
        Path(folder, f"rank-{rank}").write_text(f"step {step}\n{line}\n")


def summary(restart: int, first_step_at: float | None) -> dict[str, float | int | None]:
    """What ``summary.json`` says of the restarts inside the allocation: how many, and the seconds
    from the last failed step's end to this start's first step."""
    folder = os.environ.get(ATTEMPT_DIR_ENV)
    after_s = None
    if restart > 0 and folder and first_step_at is not None:
        previous = Path(folder).with_name(Path(folder).name.rpartition("-")[0] + f"-{restart - 1}")
        with contextlib.suppress(OSError, ValueError):
            after_s = round(first_step_at - float((previous / FAILED_AT).read_text()), 3)
    return {"restarts_in_allocation": restart, "restart_to_first_step_s": after_s}
