"""Helpers of the tests against the real cluster."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def release_requeue_hold(job_id: str, timeout_s: float = 120) -> None:
    """SLURM keeps a requeued job ineligible for ~2 minutes (BeginTime: its own policy, right on a
    shared cluster); seeing that hold proves the requeue happened, and releasing it keeps the test
    short.

    Not at once: slurmd revoked the first life's credential when it killed it, and refuses any
    credential of that job made in the same wall-clock second or before ("Killing non-startable
    batch JobId=N: Job credential revoked", and the job ends FAILED). The revocation came before
    squeue said PENDING, so a release in the next second starts a life slurmd accepts. (Released
    at once, this failed one run in three on a loaded 2-core machine.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True,
                             text=True).stdout.split()
        if out[:2] == ["PENDING", "BeginTime"]:
            time.sleep(1.2 - time.time() % 1)  # into the next wall-clock second, with a margin
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} was never held for requeue")


def wait_for(path: Path, ok: Callable[[str], bool] = lambda text: True, timeout_s: float = 240) -> None:
    """Until ``path`` exists and its text passes ``ok`` (a rank's progress file, a record)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and ok(path.read_text()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared (or never passed its check)")


def logs(run_dir: Path) -> str:
    """Every rank's output and error log of a ``switchyard run`` job, in one text."""
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "submitit").glob("*_log.*")))


def job_story(job_id: str, run_dir: Path, lines: int = 25) -> str:
    """What a failing SLURM test prints: every life of the job as accounting has it (``sacct
    --duplicates``: a requeued job's earlier lives too) and the last lines of each rank's logs."""
    lives = subprocess.run(["sacct", "-D", "-n", "-P", "-o", "JobID,State,ExitCode,Start,End,NodeList",
                            "-j", job_id], capture_output=True, text=True).stdout
    parts = [f"sacct -D -j {job_id}:\n{lives}"]
    for path in sorted((run_dir / "submitit").glob("*_log.*")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"== {path.name}\n" + "\n".join(tail))
    return "\n".join(parts)
