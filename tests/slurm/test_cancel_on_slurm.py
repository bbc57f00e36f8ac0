"""`switchyard cancel` on the real cluster returns once the cancelled ranks have ended (issue 27:
it returned in 0.3 s while the tasks were still COMPLETING and writing their checkpoint)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from train_helpers import run_train

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

# A rank that takes a few seconds to handle SIGTERM, as one writing its checkpoint does (less
# than the local cluster's KillWait of 5 s, after which SLURM would SIGKILL it).
SLOW_TO_STOP = textwrap.dedent("""
    import os, signal, sys, time
    run_dir, rank = os.environ["SWITCHYARD_RUN_DIR"], os.environ["RANK"]

    def stop(signum, frame):
        time.sleep(3)
        open(os.path.join(run_dir, f"saved-{rank}"), "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(run_dir, f"started-{rank}"), "w").close()
    time.sleep(600)
""")


def test_cancel_returns_once_the_ranks_have_handled_sigterm(tmp_path: Path, queued: list[str]) -> None:
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    (tmp_path / "slow.py").write_text(SLOW_TO_STOP)
    run_dir = tmp_path / "run"

    def switchyard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    proc = switchyard("run", "cluster=slurm", "cluster.wait=false", f"hydra.run.dir={run_dir}",
                      "--", sys.executable, "slow.py")
    match = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert match is not None, proc.stdout + proc.stderr[-3000:]
    queued.append(match.group(1))
    deadline = time.monotonic() + 120
    while not all((run_dir / f"started-{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    cancelled = switchyard("cancel", "1/0")
    assert cancelled.returncode == 0, cancelled.stderr
    assert (run_dir / "saved-0").exists() and (run_dir / "saved-1").exists(), \
        "cancel returned while the ranks were still handling SIGTERM"
    assert "waiting for job(s)" in cancelled.stderr and "still ending" not in cancelled.stderr



def test_a_stop_by_scancel_signal_term_is_recorded_as_a_clean_stop(tmp_path: Path, queued: list[str]) -> None:
    """``scancel --signal=TERM``: the ranks checkpoint and leave their stop files, but sacct said
    FAILED 127:0 (the ranks' 255, which SLURM folds into 127) and status/show said FAILED with no
    exit and no error. Now the launcher exits 143 (sacct 15:0: SIGTERM), and the registry records
    the stop as `switchyard cancel` records it: CANCELLED, where it stopped, exit 143."""
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    run_dir = tmp_path / "run"
    proc = run_train("cluster=slurm", "cluster.wait=false", "optim.max_steps=1000000", "log_every_steps=5",
                     "data.demo_num_samples=256", "memory.estimate=off", cache_dir=tmp_path / "cache",
                     run_dir=run_dir, env=env)
    match = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert match is not None, proc.stdout + proc.stderr[-3000:]
    job_id = match.group(1)
    queued.append(job_id)  # cancelled at the end whatever happens (tests/slurm/conftest.py)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, "the job never trained"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    slurm_query.wait_for_terminal_states([job_id], timeout_s=240)
    exits = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], check=True,
                           capture_output=True, text=True).stdout.split()
    assert exits == ["FAILED|15:0"]  # SLURM's own verdict on a job that ended itself; was 127:0
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    (job,) = json.loads(status.stdout)["jobs"]
    stop = re.fullmatch(r"stopped on a signal to its ranks \(scancel --signal, or preemption\): stopped by "
                        rf"PREEMPTED at step (\d+); checkpoint in {re.escape(str(run_dir / 'checkpoints'))}",
                        job["error"] or "")
    assert (job["state"], job["exit_code"]) == ("CANCELLED", 143) and stop is not None, job
    assert (run_dir / "checkpoints" / f"step-{int(stop.group(1)):09d}.pt").exists()
    assert job["total_steps"] == 1000000 and job["step"] is not None
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", "1/0"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert "CANCELLED" in shown and "FAILED" not in shown and "why try" not in shown
