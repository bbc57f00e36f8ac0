"""The Lightning recipe (docs/recipes/lightning_ddp.py) as one 2x2 job on the local cluster: Lightning's
SLURMEnvironment sees world 4, each eval sample is counted once, and `scancel --signal=USR2`
mid-epoch reaches switchyard.preemption's handler (Lightning's own listens to SIGUSR1): the
checkpoint carries the data module's position, the job is requeued, and the samples seen across
both attempts are an uninterrupted run's, in the same order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from lightning_helpers import EVAL_SAMPLES, eval_counts, recipe_command, seen, uninterrupted, write_data
from slurm_helpers import job_story, logs, release_requeue_hold, wait_for

from orchestrator.launch import slurm_query

# the recipe's ranks import Lightning; this process need not (every worker collects this module)
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(find_spec("lightning") is None, reason="needs lightning")]


def switchyard_run(tmp_path: Path, name: str, overrides: list[str], *args: str
                   ) -> subprocess.CompletedProcess[str]:
    record = tmp_path / f"record-{name}"
    record.mkdir()
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", *overrides, f"hydra.run.dir={tmp_path / name}",
         "--", *recipe_command(tmp_path / "train", tmp_path / "eval", record, "--epochs", "3", *args)],
        cwd=tmp_path, env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")},
        capture_output=True, text=True, timeout=400)


def test_lightning_2x2_requeued_on_usr2_sees_the_uninterrupted_runs_samples(
        tmp_path: Path, queued: list[str]) -> None:
    write_data(tmp_path)
    proc = switchyard_run(tmp_path, "slurm", ["cluster=slurm", "parallelism.nodes=2",
                                              "parallelism.procs_per_node=2", "cluster.wait=false"],
                          "--sleep-s", "0.5")
    match = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert proc.returncode == 0 and match is not None, proc.stdout + proc.stderr[-3000:]
    job_id = match.group(1)
    queued.append(job_id)
    # 96 samples over 4 ranks in batches of 4: 6 batches an epoch; batch 8 is mid-epoch 1
    wait_for(tmp_path / "slurm" / "checkpoints" / "progress", lambda t: t.isdigit() and int(t) >= 8)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    release_requeue_hold(job_id)
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)
    text = logs(tmp_path / "slurm")
    assert states[job_id] == "COMPLETED", job_story(job_id, tmp_path / "slurm")
    assert f"switchyard: requeueing job {job_id}: the command asked to be requeued" in text
    assert "world 4 via SLURMEnvironment: done after epoch 2, restart 1" in text
    # what the same world (4 ranks) trains on uninterrupted, from the data module's sampler
    expected = uninterrupted(tmp_path / "train", world=4, epochs=3)
    for rank in range(4):
        assert seen(tmp_path / "record-slurm", rank) == expected[rank]
        assert eval_counts(tmp_path / "record-slurm", rank) == [EVAL_SAMPLES] * 3
