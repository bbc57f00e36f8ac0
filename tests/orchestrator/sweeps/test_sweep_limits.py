"""Sweeps larger than the cluster allows: a group with more points than MaxArraySize goes out as
several arrays, and a sweep that does not fit under MaxJobCount is refused before anything is
queued, naming the limit.

scontrol, squeue and sbatch are small scripts first on PATH (tests/slurm_fakes.py) reporting
small limits; tests/slurm/test_sweep_limits_on_slurm.py runs the same paths on the real cluster.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sweep_probe
from hypothesis import given
from hypothesis import strategies as st
from slurm_fakes import calls, fake_slurm, scontrol_config

from orchestrator.launch import slurm_query
from orchestrator.registry.db import Job, Registry
from orchestrator.registry.states import SUBMIT_FAILED, SUBMITTED
from orchestrator.sweeps import arrays
from orchestrator.sweeps.arrays import (
    LauncherSettings,
    SweepError,
    array_chunks,
    check_cluster_limits,
    parallelism_share,
    resources_for,
)


@pytest.fixture(autouse=True)
def fresh_cluster_limits() -> Iterator[None]:
    """cluster_limits() is asked once per process: each test starts without the last one's answer."""
    slurm_query.cluster_limits.cache_clear()
    yield
    slurm_query.cluster_limits.cache_clear()


@given(st.integers(min_value=0, max_value=5000), st.integers(min_value=1, max_value=1200))
def test_array_chunks_cover_every_point_once_in_the_fewest_arrays(num_points: int, size: int) -> None:
    chunks = array_chunks(num_points, size)
    assert [i for chunk in chunks for i in chunk] == list(range(num_points))
    assert all(1 <= len(chunk) <= size for chunk in chunks)
    assert len(chunks) == math.ceil(num_points / size)
    assert array_chunks(num_points, None) == ([range(num_points)] if num_points else [])


@given(st.integers(min_value=1, max_value=1000), st.integers(min_value=1, max_value=50))
def test_split_arrays_share_the_groups_parallelism(parallelism: int, num_arrays: int) -> None:
    share = parallelism_share(parallelism, num_arrays)
    assert share >= 1
    assert share * num_arrays <= max(parallelism, num_arrays)


def test_a_sweep_split_over_max_array_size_goes_out_as_several_arrays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sbatch: the array line of each script it is given, then a new job id (41, 42, ...).
    log = fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(3, 10000), sbatch=(
        f'grep -h -- "--array" "$1" >> {tmp_path / "arrays"}\n'
        f'n=$(( $(wc -l < {tmp_path / "arrays"}) + 40 )); echo "Submitted batch job $n"'))
    resources = resources_for(LauncherSettings(array_parallelism=4), None)
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = reg.create_sweep("app", "x=1,2,3,4,5", str(tmp_path), "slurm", "entry")
        reg.add_jobs(Job(sweep_id, n, [f"x={n}"], str(tmp_path / str(n)), {}, None) for n in range(5))
        jobs = arrays.submit_array(reg, sweep_id, resources, {n: str(tmp_path / str(n)) for n in range(5)},
                                     tmp_path / ".submitit" / "%j")
        assert [str(j.job_id) for j in jobs] == ["41_0", "41_1", "41_2", "42_0", "42_1"]
        assert (tmp_path / "arrays").read_text().split() == ["#SBATCH", "--array=0-2%2",
                                                             "#SBATCH", "--array=0-1%2"]
        latest = reg.latest_attempts(sweep_id)
        assert [(latest[n].state, latest[n].slurm_id) for n in range(5)] == [
            (SUBMITTED, "41_0"), (SUBMITTED, "41_1"), (SUBMITTED, "41_2"), (SUBMITTED, "42_0"),
            (SUBMITTED, "42_1")]
    assert len(calls(log, "scontrol")) == 1  # the limits: asked once


def test_an_array_refused_after_another_was_queued_says_what_went_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(2, 10000), sbatch=(
        f'echo x >> {tmp_path / "n"}\n'
        f'if [ "$(wc -l < {tmp_path / "n"})" -gt 1 ]; then echo "sbatch: error: QOSMaxSubmitJobPerUserLimit"'
        f' >&2; exit 1; fi\necho "Submitted batch job 41"'))
    resources = resources_for(LauncherSettings(), None)
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = reg.create_sweep("app", "", str(tmp_path), "slurm", "entry")
        reg.add_jobs(Job(sweep_id, n, [], str(tmp_path / str(n)), {}, None) for n in range(5))
        with pytest.raises(arrays.SubmitError, match="QOSMaxSubmitJobPerUserLimit") as refused:
            arrays.submit_array(reg, sweep_id, resources, {n: str(tmp_path / str(n)) for n in range(5)},
                                  tmp_path / ".submitit" / "%j")
        assert [str(j.job_id) for j in refused.value.queued] == ["41_0", "41_1"]
        assert [a.state for a in reg.latest_attempts(sweep_id).values()] == [
            SUBMITTED, SUBMITTED, SUBMIT_FAILED, SUBMIT_FAILED, SUBMIT_FAILED]


def test_more_jobs_than_max_job_count_leaves_room_for_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 jobs held by the controller (one of them an array task), MaxJobCount 10: 5 more fit
    # (slurmctld refuses when held + new reaches MaxJobCount).
    fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(1001, 10),
               squeue='printf "11\\n12\\n13_0\\n14\\n"')
    assert check_cluster_limits(5).max_job_count == 10
    with pytest.raises(SweepError) as refused:
        check_cluster_limits(6)
    message = str(refused.value)
    for part in ("6 jobs do not fit", "MaxJobCount=10", "holds 4 jobs", "5 more fit", "nothing was queued",
                 "hydra.launcher.array_parallelism"):
        assert part in message, message


def test_limits_that_cannot_be_read_or_forbid_arrays_refuse_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(0, 10000), squeue="true")
    with pytest.raises(SweepError, match=r"disables job arrays \(MaxArraySize=0"):
        check_cluster_limits(1)
    slurm_query.cluster_limits.cache_clear()
    fake_slurm(tmp_path, monkeypatch,
               scontrol='echo "slurm_load_ctl_conf error: Unable to contact" >&2; exit 1')
    with pytest.raises(SweepError, match=r"cannot read SLURM's limits .*Unable to contact"):
        check_cluster_limits(1)


def test_a_percent_in_the_sweep_dir_is_refused_before_anything_is_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch expands % in the log paths: sw%4 put the logs in sw404_0, where nothing looks."""
    log = fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(1001, 10000), squeue="true",
                     sbatch='echo "Submitted batch job 41"')
    app = sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label="percent")
    proc = subprocess.run([sys.executable, str(app), "-m", "x=1,2", "hydra.launcher.wait=false",
                           f"hydra.sweep.dir={tmp_path / 'sw%4'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=sweep_probe.registry_env(tmp_path))
    assert proc.returncode != 0, proc.stdout
    assert f"hydra.sweep.dir='{tmp_path / 'sw%4'}' is invalid: it holds '%'" in proc.stderr, proc.stderr
    assert "nothing was queued" in proc.stderr and "Traceback" not in proc.stderr
    assert calls(log, "sbatch") == []


def srun_task(procid: int) -> dict[str, str]:
    """The variables srun gives task ``procid`` of a 2-task step on one node."""
    return {"SLURM_JOB_ID": "99", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid), "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1"}


def test_a_sweep_started_in_every_task_of_an_srun_step_is_submitted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each task submitted it, two sweeps of the same points."""
    log = fake_slurm(tmp_path, monkeypatch, scontrol=scontrol_config(1001, 10000), squeue="true",
                     sbatch='echo "Submitted batch job 41"')
    app = sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label="srun")
    procs = [subprocess.run([sys.executable, str(app), "-m", "x=1,2", "hydra.launcher.wait=false"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**sweep_probe.registry_env(tmp_path), **srun_task(procid)})
             for procid in (1, 0)]
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-2000:] for p in procs]
    assert ("task 1 of 2 of slurm-99-step0: the sweep is submitted by task 0 only, so it goes out once"
            in procs[0].stdout), procs[0].stdout
    assert "sweep_id: 1" in procs[1].stdout and "sweep_id" not in procs[0].stdout
    assert len(calls(log, "sbatch")) == 1
