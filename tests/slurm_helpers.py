"""Helpers of the tests against the real cluster."""

from __future__ import annotations

import subprocess
import time


def release_requeue_hold(job_id: str, timeout_s: float = 120) -> None:
    """SLURM keeps a requeued job ineligible for ~2 minutes (BeginTime: its own policy, right on a
    shared cluster); seeing that hold proves the requeue happened, and releasing it keeps the test
    short."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True,
                             text=True).stdout.split()
        if out[:2] == ["PENDING", "BeginTime"]:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} was never held for requeue")
