"""How long before the time limit SLURM's ``SIGUSR2`` comes: the lead time the checkpoint it
triggers must fit in, and ``cluster.signal_delay_s=auto``, which takes it from what was measured.

The rule is one: twice the slowest checkpoint save, plus ``SIGNAL_MARGIN_S``. A save still being
written at the time limit is killed half-written (the previous checkpoint is kept), and the save at
the signal can be slower than the ones measured (a busier file system, a larger state). The ranks
warn with it at the end of a run (``lead_time_warning``); ``auto`` applies it at submission to the
figures the last run in the same directory left in its ``summary.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from durable import atomic
from orchestrator.config import DEFAULT_SIGNAL_DELAY_S, ClusterConfig, ConfigError, signal_delay_within

# Seconds added to twice the slowest save: the stop waits for the next step boundary, and a
# requeue's scontrol call must finish before SLURM's SIGKILL at the limit.
SIGNAL_MARGIN_S = 10
CHOICE_FILE = "signal_delay.json"  # RUN/signal_delay.json: what was chosen at submission, and why
SUMMARY_FILE = "summary.json"
SLOWEST_KEY = "checkpoint_slowest_save_s"  # the figure auto reads from the last run's summary


def fitting_s(slowest_save_s: float) -> int:
    """The lead time the rule asks for after a save of ``slowest_save_s`` seconds."""
    return math.ceil(2 * slowest_save_s + SIGNAL_MARGIN_S)


def lead_time_warning(signal_delay_s: int, slowest_save_s: float) -> str | None:
    """A warning when the time-limit signal comes too late for the checkpoint it triggers: less
    than ``fitting_s`` of the slowest save measured in this run."""
    fits = fitting_s(slowest_save_s)
    if slowest_save_s <= 0 or signal_delay_s >= fits:
        return None
    return (f"cluster.signal_delay_s={signal_delay_s} may be too short: the slowest checkpoint save "
            f"took {slowest_save_s:.1f} s, and the save at the time-limit signal needs about twice "
            f"that plus {SIGNAL_MARGIN_S} s to finish before SLURM kills the job "
            f"(try cluster.signal_delay_s={fits})")


@dataclass(frozen=True)
class Choice:
    """The lead time a submission uses, and where it came from (for the terminal and summary.json)."""

    seconds: int
    source: str

    def line(self) -> str:
        return f"signal_delay_s: {self.seconds} ({self.source})"

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "source": self.source}


def last_slowest_save(run_dir: Path) -> float | None:
    """The slowest save the last run in ``run_dir`` measured; None when it left no such figure
    (no run yet, a run that saved nothing, a summary that does not parse)."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    slowest = summary.get(SLOWEST_KEY) if isinstance(summary, dict) else None
    if isinstance(slowest, bool) or not isinstance(slowest, (int, float)) or not slowest > 0:
        return None
    return float(slowest)


def choose(cluster: ClusterConfig, run_dir: Path) -> Choice:
    """``cluster.signal_delay_s`` as a number of seconds. ``auto``: ``fitting_s`` of the slowest
    save the last run in ``run_dir`` measured, or the default when there is none; refused when
    that does not fit below the time limit (no job could checkpoint in it)."""
    if cluster.signal_delay_s != "auto":
        return Choice(int(cluster.signal_delay_s), f"cluster.signal_delay_s={cluster.signal_delay_s}")
    slowest = last_slowest_save(run_dir)
    limit_s = cluster.timeout_min * 60
    if slowest is None:
        if limit_s <= DEFAULT_SIGNAL_DELAY_S:  # refused as auto: the user never typed the default
            raise ConfigError(f"cluster.signal_delay_s='auto' is invalid here: no previous run in "
                              f"{run_dir} measured a checkpoint save, so auto takes the default "
                              f"{DEFAULT_SIGNAL_DELAY_S} s, and the time limit is {limit_s} s (try "
                              f"cluster.signal_delay_s={signal_delay_within(limit_s)}, or cluster."
                              f"timeout_min={math.ceil(DEFAULT_SIGNAL_DELAY_S / 60) + 1})")
        return Choice(DEFAULT_SIGNAL_DELAY_S, f"auto: no checkpoint save measured by a previous run in "
                      f"{run_dir}, so the default")
    seconds = fitting_s(slowest)
    if seconds >= limit_s:
        raise ConfigError(f"cluster.signal_delay_s='auto' is invalid here: the last run in {run_dir} "
                          f"saved a checkpoint in {slowest:.1f} s, so the signal would need {seconds} s "
                          f"before the time limit, and the limit is {limit_s} s (try "
                          f"cluster.timeout_min={math.ceil(seconds / 60) + 1}, or a number of seconds)")
    return Choice(seconds, f"auto: 2 x {slowest:.1f} s, the slowest checkpoint save of the last run "
                  f"in this directory ({SUMMARY_FILE}), + {SIGNAL_MARGIN_S} s")


def at_submission(cluster: ClusterConfig, run_dir: Path, announce: bool = True) -> ClusterConfig:
    """Before anything reads it: ``cluster`` with its lead time as a number (what sbatch and the
    ranks get). On SLURM the choice is printed (a dry run's output too; not for each point of a
    sweep: ``announce=False``) and recorded in ``RUN/signal_delay.json``, where rank 0 puts it in
    the run's summary."""
    choice = choose(cluster, run_dir)
    if cluster.mode == "slurm":
        if announce:
            print(choice.line(), flush=True)
        atomic.write_json(run_dir / CHOICE_FILE, choice.as_dict(), indent=1, durable=False)
    return replace(cluster, signal_delay_s=choice.seconds)


def recorded(run_dir: Path) -> dict[str, Any] | None:
    """The choice written at submission; None when there is none or it does not parse."""
    try:
        found = json.loads((run_dir / CHOICE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def submitted_seconds(cluster: ClusterConfig, run_dir: Path) -> int:
    """On a rank: the lead time SLURM was given. ``auto`` is what the submission chose
    (``RUN/signal_delay.json``); a run not submitted through ``at_submission`` gets the default."""
    if cluster.signal_delay_s != "auto":
        return int(cluster.signal_delay_s)
    seconds = (recorded(run_dir) or {}).get("seconds")
    return seconds if isinstance(seconds, int) else DEFAULT_SIGNAL_DELAY_S
