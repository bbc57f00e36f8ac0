"""The signals that ask a job to stop, and the flag they set: one home for the trainer's ranks
(orchestrator/training/preemption.py) and for a user's own script (switchyard.preemption).

A handler only records *that* a stop was asked for, and why; the code acts on it at its next step
boundary. Imports the standard library alone, so a user's script that imports switchyard.preemption
loads neither torch nor the rest of Switchyard.
"""

from __future__ import annotations

import signal
from enum import IntEnum
from types import FrameType

# SIGUSR2: SLURM's --signal=USR2@cluster.signal_delay_s before the time limit. SIGTERM: preemption
# (or scancel). Only the process that trains acts on them: its DataLoader workers ignore them (torch's
# worker handler would die of SIGTERM, which SLURM sends to every process of the step, and the
# trainer would raise before it reaches the step boundary and checkpoints).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopReason(IntEnum):
    """Ordered so that a MAX-reduction across ranks picks the most severe reason."""

    NONE = 0
    TIME_LIMIT = 1  # SIGUSR2: requeue
    PREEMPTED = 2  # SIGTERM: checkpoint, let SLURM decide


def reason_of(signum: int) -> StopReason:
    return StopReason.TIME_LIMIT if signum == signal.SIGUSR2 else StopReason.PREEMPTED


class StopFlag:
    """Set from signal handlers; read at step boundaries (by a trainer: reduced across ranks)."""

    def __init__(self) -> None:
        # Appending is one atomic step under the GIL: no lock, which a second signal arriving
        # while the first one's handler held it would wait on forever (handlers run on the main
        # thread, between any two bytecodes of the code they interrupt).
        self._requested: list[StopReason] = []

    @property
    def reason(self) -> StopReason:
        """The most severe reason asked for so far; NONE while nothing was."""
        return max(self._requested, default=StopReason.NONE)

    def request(self, reason: StopReason) -> None:
        self._requested.append(reason)

    def install(self) -> None:
        """Handle STOP_SIGNALS by setting this flag (replacing any handler, submitit's included:
        it checkpoints inside its handler, on rank 0 only)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request(reason_of(signum))
