"""``orchestrator.launch.job_entry``: a job whose process runs Switchyard's code starts through it and
ends as submitit's own entry would (its result, its traceback, ``atexit``), without the interpreter's
teardown; a job that runs a user's own function keeps submitit's entry. Real local jobs (submitit's
controller and task processes)."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import submitit

from orchestrator.config import AppGroups, ClusterConfig, ParallelismConfig
from orchestrator.launch import job_entry
from orchestrator.sweeps import arrays

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the jobs' processes cannot import this file


class TornDown:
    """Says so when the interpreter's teardown frees it (a module's globals are cleared)."""

    def __del__(self) -> None:
        os.write(1, b"torn down\n")


def job(value: int) -> dict[str, object]:
    atexit.register(os.write, 1, b"atexit ran\n")
    json.torn_down = TornDown()  # type: ignore[attr-defined]  # held by a module, as torch holds its state
    return {"value": value, "argv0": Path(sys.argv[0]).name}


def failing_job() -> None:
    raise ValueError("the job's own error")


def logs(j: submitit.Job[object]) -> str:
    return Path(j.paths.stdout).read_text() + Path(j.paths.stderr).read_text()


def test_a_job_through_the_entry_returns_its_result_runs_atexit_and_skips_the_teardown(
        tmp_path: Path) -> None:
    ours = job_entry.LocalExecutor(folder=tmp_path / "ours")
    theirs = submitit.LocalExecutor(folder=tmp_path / "theirs")
    for executor in (ours, theirs):
        executor.update_parameters(timeout_min=2)
    jobs = [ours.submit(job, 7), theirs.submit(job, 7), ours.submit(failing_job)]
    assert jobs[0].result() == jobs[1].result() == {"value": 7, "argv0": "_submit.py"}  # submitit's argv
    assert "atexit ran" in logs(jobs[0]) and "torn down" not in logs(jobs[0])
    assert "atexit ran" in logs(jobs[1]) and "torn down" in logs(jobs[1])  # submitit's entry: the teardown
    with pytest.raises(submitit.core.utils.FailedJobError, match="the job's own error"):
        jobs[2].result()
    assert "Traceback" in logs(jobs[2])


def test_only_switchyards_own_jobs_start_through_it(tmp_path: Path) -> None:
    """jobs.train and switchyard run (their app check says own_code) start through the entry; a
    plain Hydra app's points and switchyard submit's functions run the user's Python: submitit's."""
    settings = arrays.LauncherSettings(executor="slurm")
    cluster, parallelism = ClusterConfig(mode="slurm"), ParallelismConfig()
    own = arrays.resources_for(settings, AppGroups(cluster, parallelism, own_code=True))
    users = arrays.resources_for(settings, AppGroups(cluster, parallelism))
    plain = arrays.resources_for(settings, None)
    assert own.own_code and not users.own_code and not plain.own_code
    folder = tmp_path / "submitit"
    assert arrays.make_executor(own, folder)._submitit_command_str.endswith(
        f"-u -m orchestrator.launch.job_entry {folder}")
    for resources in (users, plain):
        assert arrays.make_executor(resources, folder)._submitit_command_str.endswith(
            f"-u -m submitit.core._submit {folder}")
    # a registry written before the field existed reads as submitit's entry
    recorded = {k: v for k, v in json.loads(own.key()).items() if k != "own_code"}
    assert arrays.Resources.from_json(recorded).own_code is False
