"""A sweep point whose rank is killed by a signal on a node is retried with that node in
--exclude, and `switchyard show` says why; once every node of the partition is left behind, the
next retry is refused before anything is queued, naming the nodes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sweep_probe

pytestmark = pytest.mark.slurm

SWITCHYARD = shutil.which("switchyard", path=str(Path(sys.executable).parent)) or "switchyard"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")
_BANNER = re.compile(r"switchyard: rank 0/1 on node (\S+) \(local rank 0, job \S+, pid (\d+)\)")


def run(tmp_path: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=tmp_path, env=sweep_probe.registry_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def switchyard(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run(tmp_path, SWITCHYARD, *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def status_row(tmp_path: Path, job: str) -> list[str]:
    """The job's row of `switchyard status`: JOB STATE TRY ..."""
    lines = switchyard(tmp_path, "status", job.split("/")[0]).stdout.splitlines()
    return next(cells for cells in (line.split() for line in lines) if cells and cells[0] == job)


def wait_for_end(tmp_path: Path, job: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := status_row(tmp_path, job)[1]) not in ENDED:
        assert time.monotonic() < deadline, state
        time.sleep(1)
    return state


def kill_running_rank(tmp_path: Path, job: str, attempt: int, timeout_s: float = 120) -> str:
    """Wait until the attempt's rank has started, SIGKILL it (the local cluster's nodes are this
    machine) as a broken node would, and return its node."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = status_row(tmp_path, job)
        if row[2] == str(attempt) and row[1] == "RUNNING":
            logs = switchyard(tmp_path, "logs", job, "--stream", "out").stdout
            found = _BANNER.search(logs)
            if found:
                os.kill(int(found.group(2)), signal.SIGKILL)
                return found.group(1)
        assert time.monotonic() < deadline, row
        time.sleep(1)


def test_a_rank_killed_on_a_node_is_retried_elsewhere_until_no_node_is_left(tmp_path: Path) -> None:
    sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label="bad-node",
                          launcher_settings={"timeout_min": 5, "job_name": f"sy-{tmp_path.name}"[:40]})
    proc = run(tmp_path, sys.executable, str(tmp_path / "app.py"), "-m", "x=1", "sleep_s=300",
               "hydra.launcher.wait=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("sweep_id: "))
    job = f"{sweep}/0"
    try:
        first = kill_running_rank(tmp_path, job, 1)
        assert wait_for_end(tmp_path, job) == "FAILED"

        resubmit = switchyard(tmp_path, "resubmit", sweep, "--failed")
        assert f"keeping {job} off {first}" in resubmit.stdout
        scripts = sorted((tmp_path / "multirun").rglob("*_submission.sh"), key=lambda p: p.stat().st_mtime)
        assert f"#SBATCH --exclude={first}\n" in scripts[-1].read_text()
        show = switchyard(tmp_path, "show", job).stdout
        assert f"try 2 avoided {first}: rank 0 was killed by a signal (srun: Killed) in try 1" in show

        second = kill_running_rank(tmp_path, job, 2)  # it ran, on the other node
        assert second != first
        assert wait_for_end(tmp_path, job) == "FAILED"
        refused = run(tmp_path, SWITCHYARD, "resubmit", sweep, "--failed")
        assert refused.returncode != 0
        assert f"avoid {', '.join(sorted([first, second]))} " in refused.stderr, refused.stderr
        assert "nothing was resubmitted" in refused.stderr
        assert status_row(tmp_path, job)[2] == "2"  # no third try was claimed
    finally:
        subprocess.run([SWITCHYARD, "cancel", sweep], cwd=tmp_path,
                       env=sweep_probe.registry_env(tmp_path), capture_output=True, timeout=120, check=False)
