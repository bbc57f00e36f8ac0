"""A job followed to its end while SLURM accounting is silent (issue 27): sacct is a script first
on PATH that prints its header alone, as it does while slurmdbd is down or restarting; squeue,
sbatch and the job are the real cluster's. The submitter waited for such a job forever (UNKNOWN
was taken as pending) and now goes by squeue and the job's result files."""

from __future__ import annotations

from pathlib import Path

import pytest
import submitit
from slurm_fakes import fake_slurm

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import submit

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(180)  # the old code waited here until accounting came back: never
def test_a_job_that_ended_while_accounting_was_silent_returns_its_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queued: list[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct='echo "JobID|State|NodeList"')
    executor = submitit.SlurmExecutor(folder=tmp_path / "logs")
    executor.update_parameters(**submit.slurm_parameters(ClusterConfig(mode="slurm", timeout_min=5),
                                                         ParallelismConfig()))
    job = submit.submit(executor, int, "7")
    queued.append(str(job.job_id))
    submit.watch_pending(job, "cancel", poll_s=0.5, patience_s=5)
    assert submit.results(job) == [7, 7]  # ParallelismConfig(): 2 ranks
