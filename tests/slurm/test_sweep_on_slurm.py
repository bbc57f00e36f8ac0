"""Sweeps on the real local cluster: submit and walk away, come back with `switchyard status`,
resubmit what failed; the config that runs is the one saved at submission; bad input queues nothing."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sweep_probe
from slurm_helpers import release_requeue_hold
from train_helpers import run_train

from orchestrator.launch import slurm_query
from orchestrator.registry.db import Registry
from orchestrator.sweeps import status

pytestmark = pytest.mark.slurm

SWITCHYARD = shutil.which("switchyard", path=str(Path(sys.executable).parent)) or "switchyard"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")
TRAIN_SMALL = ["optim.max_steps=20", "data.demo_num_samples=256", "data.batch_size=16", "log_every_steps=5"]


def write_app(tmp_path: Path, label: str = "from-yaml") -> None:
    sweep_probe.write_app(tmp_path, launcher="switchyard_slurm", label=label,
                          launcher_settings={"timeout_min": 2, "job_name": f"sy-{tmp_path.name}"[:40]})


def env_for(tmp_path: Path) -> dict[str, str]:
    return sweep_probe.registry_env(tmp_path)


def run(tmp_path: Path, *cmd: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=tmp_path, env=env_for(tmp_path), capture_output=True,
                          text=True, timeout=timeout_s)


def train_sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python -m jobs.train -m OVERRIDES``, as ``run`` runs a command."""
    return run_train(*overrides, multirun=True, cwd=tmp_path, env=env_for(tmp_path), timeout=300)


def run_app(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run(tmp_path, sys.executable, str(tmp_path / "app.py"), "-m", *overrides)


def switchyard(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run(tmp_path, SWITCHYARD, *args, timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def status_table(tmp_path: Path, sweep: str) -> dict[str, list[str]]:
    """`switchyard status SWEEP` as a user reads it, piped: {job: its row's cells}. The tests poll it
    every half second, so the command's call runs in this process (``status.cmd_status``, as the
    CLI calls it: the same table, a process start less per poll); the other commands here run as
    the user types them."""
    out = io.StringIO()
    with Registry(env_for(tmp_path)["SWITCHYARD_REGISTRY"]) as registry:
        assert status.cmd_status(registry, sweep, as_json=False, out=out) == 0
    lines = out.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB "))
    return {cells[0]: cells for cells in (line.split() for line in lines[header + 1:])}


def poll_until_ended(tmp_path: Path, sweep: str, timeout_s: float = 180) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        table = status_table(tmp_path, sweep)
        if all(row[1] in ENDED for row in table.values()):
            return table
        assert time.monotonic() < deadline, table
        time.sleep(1)


def sweep_id(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("sweep_id: "))
    return line.split()[1]


def ran(tmp_path: Path, x: int) -> list[str]:
    return [p.read_text() for p in sorted((tmp_path / "out").glob(f"ran-{x}-*"))]


def test_six_points_non_blocking_then_resubmit_only_the_failed_one(tmp_path: Path) -> None:
    write_app(tmp_path)
    (tmp_path / "out" / "fail-3").touch()  # point #2 (x=3) fails on the node, not at submission
    t0 = time.monotonic()
    proc = run_app(tmp_path, "x=1,2,3,4,5,6", "hydra.launcher.wait=false")
    sweep = sweep_id(proc)
    assert time.monotonic() - t0 < 30  # returned after submission, without waiting for the jobs
    assert f"switchyard status {sweep}" in proc.stdout
    assert "6 jobs submitted in 1 submission(s)" in proc.stdout  # one array, one sbatch

    table = poll_until_ended(tmp_path, sweep)
    assert {job: row[1] for job, row in table.items()} == {
        f"{sweep}/{n}": "FAILED" if n == 2 else "COMPLETED" for n in range(6)}
    array_ids = {row[4].split("_")[0] for row in table.values()}
    assert len(array_ids) == 1

    (tmp_path / "out" / "fail-3").unlink()
    resubmit = switchyard(tmp_path, "resubmit", sweep, "--failed")
    assert f"{sweep}/2" in resubmit.stdout and f"{sweep}/0" not in resubmit.stdout

    table = poll_until_ended(tmp_path, sweep)
    assert all(row[1] == "COMPLETED" for row in table.values()), table
    assert {job: row[2] for job, row in table.items()} == {  # TRY: only the failed point ran again
        f"{sweep}/{n}": "2" if n == 2 else "1" for n in range(6)}
    assert table[f"{sweep}/2"][4].split("_")[0] not in array_ids  # as a new submission
    assert [len(ran(tmp_path, x)) for x in range(1, 7)] == [1, 1, 2, 1, 1, 1]
    show = switchyard(tmp_path, "show", f"{sweep}/2").stdout
    assert "ValueError: x=3 was told to fail" in show and "label: from-yaml" in show


def test_the_saved_config_runs_even_if_the_yaml_changes_while_queued(tmp_path: Path) -> None:
    write_app(tmp_path, label="original")
    proc = run_app(tmp_path, "x=1,2,3", "sleep_s=1", "hydra.launcher.wait=false",
                   "hydra.launcher.array_parallelism=1")  # one at a time: the last ones wait queued
    sweep = sweep_id(proc)
    write_app(tmp_path, label="edited")  # what a user does next, with jobs still in the queue
    assert status_table(tmp_path, sweep)[f"{sweep}/2"][1] in ("SUBMITTED", "PENDING")
    table = poll_until_ended(tmp_path, sweep)
    assert all(row[1] == "COMPLETED" for row in table.values()), table
    assert [ran(tmp_path, x) for x in (1, 2, 3)] == [["original"], ["original"], ["original"]]


def test_the_issue_command_trains_every_point_and_status_shows_progress(tmp_path: Path) -> None:
    proc = train_sweep(tmp_path, "optim.lr=1e-3,3e-4", "model=mlp,transformer", "cluster=slurm",
                       "cluster.wait=false", *TRAIN_SMALL, f"data.cache_dir={tmp_path / 'cache'}",
                       f"hydra.sweep.dir={tmp_path / 'multirun'}", "cluster.job_name=sy-train")
    sweep = sweep_id(proc)
    table = poll_until_ended(tmp_path, sweep, timeout_s=300)
    assert [row[1] for row in table.values()] == ["COMPLETED"] * 4, table
    assert all(row[6] == "20/20" and float(row[7]) > 0 for row in table.values()), table
    assert [row[-2:] for row in table.values()] == [  # only what varies is shown per job
        ["optim.lr=0.001", "model=mlp"], ["optim.lr=0.001", "model=transformer"],
        ["optim.lr=0.0003", "model=mlp"], ["optim.lr=0.0003", "model=transformer"]]
    summary = json.loads((tmp_path / "multirun" / "3" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    show = switchyard(tmp_path, "show", f"{sweep}/3").stdout
    assert "_target_: jobs.models.RowTransformer" in show and "lr: 0.0003" in show
    logs = switchyard(tmp_path, "logs", f"{sweep}/3", "--rank", "1", "--stream", "out").stdout
    assert "switchyard: rank 1/2 on node n" in logs


@pytest.mark.queues_nothing
def test_bad_input_fails_at_submission_naming_the_point_and_queues_nothing(tmp_path: Path) -> None:
    base = ["cluster=slurm", *TRAIN_SMALL, f"data.cache_dir={tmp_path / 'cache'}",
            f"hydra.sweep.dir={tmp_path / 'multirun'}", f"cluster.job_name=sy-bad-{os.getpid()}"]
    partition = train_sweep(tmp_path, *base, "cluster.partition=debug,nope")
    assert partition.returncode != 0
    assert "sweep point #1 (" in partition.stderr and "cluster.partition=nope)" in partition.stderr
    assert "cluster.partition='nope' is invalid: no such partition (partitions: debug) " \
           "(try cluster.partition=debug)" in partition.stderr
    value = train_sweep(tmp_path, *base, "optim.lr=1e-3,-1")
    assert value.returncode != 0 and "sweep point #1 (" in value.stderr
    assert "optim.lr=-1.0 is invalid: must be > 0 and <= 10" in value.stderr
    unknown = train_sweep(tmp_path, *base, "model=mlp,transformer", "model.hidden_dim=32")  # mlp has it only
    assert unknown.returncode != 0 and "model.hidden_dim" in unknown.stderr
    queued = subprocess.run(["squeue", "-h", "-n", f"sy-bad-{os.getpid()}"], capture_output=True,
                            text=True, check=True).stdout
    assert queued.strip() == ""
    assert json.loads(switchyard(tmp_path, "status", "--json").stdout)["sweeps"] == []


def test_cancel_one_job_then_the_whole_sweep(tmp_path: Path) -> None:
    write_app(tmp_path)
    sweep = sweep_id(run_app(tmp_path, "x=1,2", "sleep_s=60", "hydra.launcher.wait=false"))
    deadline = time.monotonic() + 60
    while any(row[1] != "RUNNING" for row in status_table(tmp_path, sweep).values()):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert "cancelled 1 job(s)" in switchyard(tmp_path, "cancel", f"{sweep}/0").stdout
    assert "cancelled 1 job(s)" in switchyard(tmp_path, "cancel", sweep).stdout
    table = status_table(tmp_path, sweep)
    assert [row[1] for row in table.values()] == ["CANCELLED", "CANCELLED"]
    ids = [row[4] for row in table.values()]
    states = slurm_query.wait_for_terminal_states(ids, timeout_s=60)
    assert {states[i] for i in ids} == {"CANCELLED"}
    assert "nothing to cancel" in switchyard(tmp_path, "cancel", sweep).stdout


def test_a_requeued_job_goes_back_to_the_queue_and_counts_its_requeue(tmp_path: Path) -> None:
    write_app(tmp_path)
    sweep = sweep_id(run_app(tmp_path, "x=1", "sleep_s=15", "hydra.launcher.wait=false"))
    job = f"{sweep}/0"

    def state_within(states: tuple[str, ...], timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while (row := status_table(tmp_path, sweep)[job])[1] not in states:
            assert time.monotonic() < deadline, row
            time.sleep(0.5)
        return row

    slurm_id = state_within(("RUNNING",), 60)[4]
    # RUNNING is SLURM's word once the node has the job; on a loaded machine the requeue came
    # before the app had started and written its run file, and the test saw one life, not two.
    deadline = time.monotonic() + 120
    while not ran(tmp_path, 1):
        assert time.monotonic() < deadline, "the first life never started the app"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", slurm_id], check=True)
    # The first life may finish its sleep after the requeue: it must not be recorded as the end.
    state_within(("PENDING",), 60)
    release_requeue_hold(slurm_id)  # no 2-min wait
    row = poll_until_ended(tmp_path, sweep)[job]
    assert (row[1], row[3]) == ("COMPLETED", "1"), row  # REQUEUES: 1
    assert len(ran(tmp_path, 1)) == 2
