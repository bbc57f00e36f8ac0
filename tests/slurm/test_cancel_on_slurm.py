"""`switchyard cancel` on the real cluster returns once the cancelled ranks have ended (issue 27:
it returned in 0.3 s while the tasks were still COMPLETING and writing their checkpoint)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

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
