"""A script run by `switchyard run` and signalled as SLURM does before the time limit: the helper
checkpoints and asks for a requeue, the job comes back and resumes; a script that ignores the
signal is requeued anyway."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_helpers import IGNORING_SCRIPT, PREEMPTIBLE_SCRIPT
from slurm_helpers import job_story, logs, release_requeue_hold, wait_for

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

TWO_NODES = ["cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=1", "cluster.wait=false"]


def submit(tmp_path: Path, script: str, queued: list[str], *overrides: str) -> tuple[str, Path]:
    (tmp_path / "script.py").write_text(script)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", *TWO_NODES, *overrides,
                           f"hydra.run.dir={run_dir}", "--", sys.executable, "script.py"], cwd=tmp_path,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")},
                          capture_output=True, text=True, timeout=300)
    match = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert proc.returncode == 0 and match is not None, proc.stdout + proc.stderr[-3000:]
    queued.append(match.group(1))
    return match.group(1), run_dir


def test_the_helper_checkpoints_on_sigusr2_and_the_job_is_requeued_and_resumes(
        tmp_path: Path, queued: list[str]) -> None:
    job_id, run_dir = submit(tmp_path, PREEMPTIBLE_SCRIPT, queued)
    wait_for(run_dir / "progress", lambda text: text.isdigit() and int(text) >= 20)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    release_requeue_hold(job_id)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)
    text = logs(run_dir)
    assert states[job_id] == "COMPLETED", job_story(job_id, run_dir)
    assert f"switchyard: requeueing job {job_id}: the command asked to be requeued" in text
    # Rank 0 asks for the requeue once it has checkpointed, and the requeue SIGTERMs every rank: a
    # rank whose time-limit signal came later than that (slurmd signals each node on its own; a full
    # run on the busy 2-core machine saw it) checkpoints on the SIGTERM, which the helper calls
    # preemption.
    # Either way it saves, and resumes exactly there.
    for rank, reasons in ((0, "time_limit"), (1, "time_limit|preempted")):
        saved = re.search(rf"rank {rank} checkpointed at step (\d+) \(({reasons})\)", text)
        assert saved is not None, job_story(job_id, run_dir)
        assert f"rank {rank} starts at step {saved.group(1)}, restart 1" in text  # resumed, not restarted
        assert (run_dir / f"final-{rank}.json").read_text() == '{"step": 300}'


def test_a_script_that_ignores_the_signal_is_requeued_anyway(tmp_path: Path, queued: list[str]) -> None:
    job_id, run_dir = submit(tmp_path, IGNORING_SCRIPT, queued, "cluster.signal_delay_s=6")
    # Both scripts ignore USR2 before they say they started: a signal sent once only rank 1 had
    # (seen in a full run) ended rank 0's script, and the job was requeued for that instead.
    wait_for(run_dir / "started-0")
    wait_for(run_dir / "started-1")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    release_requeue_hold(job_id)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)
    text = logs(run_dir)
    assert states[job_id] == "COMPLETED", text[-3000:]
    assert "still runs 3 s after the time-limit signal; requeueing without its checkpoint" in text
    assert "rank 0 restart 1" in text and "rank 1 restart 1" in text
