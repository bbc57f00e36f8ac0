"""A SLURM job followed with ``cluster.wait=true`` shows its queue state while it pends, then rank 0's
progress (issue 53, item 8). Through a pipe: whole lines, no carriage return."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from train_helpers import CHEAP, run_train

pytestmark = pytest.mark.slurm


def test_a_followed_job_shows_its_queue_state_then_its_progress(tmp_path: Path) -> None:
    blocker = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/blocker-%j.out",
                              "--wrap=sleep 8"], capture_output=True, text=True, check=True).stdout.strip()
    try:
        proc = run_train(*CHEAP, "cluster=slurm", f"cluster.dependency=afterany:{blocker}",
                         "optim.max_steps=600", "log_every_steps=20", "data.demo_num_samples=256",
                         "data.batch_size=16", cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
                         timeout=400)
    finally:
        subprocess.run(["scancel", blocker], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    lines = proc.stderr.splitlines()
    # squeue's reason (Dependency, Priority) once the scheduler has given one: "None" just after sbatch.
    pending = [i for i, line in enumerate(lines)
               if re.fullmatch(rf"job {job_id}: PENDING( \(\w+\))?, waited \d+ (s|min)", line)]
    running = [i for i, line in enumerate(lines) if re.match(r"rank 0: step \d+/600 \(\d+%\)", line)]
    assert pending and running and pending[0] < running[0], proc.stderr
    assert "\r" not in proc.stderr
    assert proc.stdout.splitlines()[0] == f"run_dir: {tmp_path / 'run'}"
