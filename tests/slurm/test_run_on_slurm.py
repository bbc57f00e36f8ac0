"""`switchyard run` and single jobs on the real two-node cluster: an unmodified DDP script as 4
ranks on n1 and n2, a failing rank named fast, and single jobs in `switchyard status`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_helpers import DDP_SCRIPT, SWEEP_SCRIPT
from train_helpers import run_train

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm


TWO_NODES = ["cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=2"]


@pytest.fixture
def registry(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}


def switchyard(env: dict[str, str], cwd: Path, *args: str, timeout_s: float = 300
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def job_id_of(proc: subprocess.CompletedProcess[str], queued: list[str]) -> str:
    match = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert match is not None, proc.stdout + proc.stderr[-3000:]
    queued.append(match.group(1))
    return match.group(1)


def test_an_unmodified_ddp_script_runs_as_4_ranks_on_both_nodes(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    proc = switchyard(registry, tmp_path, "run", *TWO_NODES, f"hydra.run.dir={run_dir}",
                      "--", sys.executable, "ddp.py")
    job_id = job_id_of(proc, queued)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob("*_log.out")))
    sums = re.findall(r"rank (\d)/4 local \d/2 .*: sum=(\S+)", logs)
    assert sorted(sums) == [("0", "10"), ("1", "10"), ("2", "10"), ("3", "10")], logs[-2000:]
    nodes = {json.loads((run_dir / "env" / f"rank-{r}.json").read_text())["node"] for r in range(4)}
    assert nodes == {"n1", "n2"}
    assert (run_dir / "telemetry" / "n1.jsonl").stat().st_size > 0
    assert (run_dir / "telemetry" / "n2.jsonl").stat().st_size > 0
    memory = json.loads((run_dir / "summary.json").read_text())["memory"]
    assert {r["rank"] for r in memory["ranks"]} == {0, 1, 2, 3}
    listed = json.loads(switchyard(registry, tmp_path, "status", job_id, "--json").stdout)
    (job,) = listed["jobs"]
    assert job["slurm_id"] == job_id and job["state"] == "COMPLETED" and job["run_dir"] == str(run_dir)
    assert "-- " in listed["sweep"]["command"] and listed["sweep"]["app"] == "run"


def test_one_rank_exiting_3_fails_the_job_within_seconds_naming_it_and_its_last_lines(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    run_dir = tmp_path / "run"
    proc = switchyard({**registry, "FAIL_RANK": "2"}, tmp_path, "run", *TWO_NODES,
                      "cluster.collective_timeout_s=900", f"hydra.run.dir={run_dir}",
                      "--", sys.executable, "ddp.py")
    job_id = job_id_of(proc, queued)
    assert proc.returncode == 2
    error = proc.stderr
    assert "rank 2 on node n2" in error and "exited with status 3" in error, error
    assert "rank 2 gives up here" in error and "the last words of the failing rank" in error
    assert "ranks [0, 1, 3] were stopped after rank 2 failed" in error
    states = slurm_query.wait_for_terminal_states([job_id], timeout_s=60)
    assert states[job_id] == "FAILED"
    started, ended = _times(job_id)
    assert ended - started < 60, "fail-fast: the others are not left waiting in a collective"


def _times(job_id: str) -> tuple[float, float]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "Start,End"], capture_output=True,
                         text=True, check=True).stdout.split()[0]
    start, end = out.split("|")
    parse = lambda s: time.mktime(time.strptime(s, "%Y-%m-%dT%H:%M:%S"))  # noqa: E731
    return parse(start), parse(end)


def test_a_single_train_job_not_waited_for_is_in_switchyard_status(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = run_train("cluster=slurm", "cluster.wait=false", "optim.max_steps=20",
                     cache_dir=tmp_path / "cache", run_dir=run_dir, env=registry, timeout=300)
    job_id = job_id_of(proc, queued)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "switchyard status 1/0" in proc.stdout
    listed = switchyard(registry, tmp_path, "status", "--json")
    (sweep,) = json.loads(listed.stdout)["sweeps"]
    assert sweep["app"] == "train" and sweep["jobs"] == 1 and "cluster.wait=false" in sweep["command"]
    shown = switchyard(registry, tmp_path, "show", job_id)
    assert shown.returncode == 0, shown.stderr
    assert "job 1/0" in shown.stdout and "max_steps: 20" in shown.stdout
    slurm_query.wait_for_terminal_states([job_id], timeout_s=300)
    (job,) = json.loads(switchyard(registry, tmp_path, "status", "1", "--json").stdout)["jobs"]
    assert job["state"] == "COMPLETED" and job["slurm_id"] == job_id
    logs = switchyard(registry, tmp_path, "logs", job_id)
    assert "switchyard: rank 0/2" in logs.stdout


def test_a_command_sweep_runs_as_a_job_array_and_a_failed_point_resubmits(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    (tmp_path / "train.py").write_text(SWEEP_SCRIPT)
    sweep_dir = tmp_path / "sweep"
    proc = switchyard(registry, tmp_path, "run", "-m", "cluster=slurm", "parallelism.nodes=2",
                      "parallelism.procs_per_node=1", "+lr=0.1,0.3", f"hydra.sweep.dir={sweep_dir}",
                      "--", sys.executable, "train.py", "--lr", "${lr}")
    first = json.loads(switchyard(registry, tmp_path, "status", "1", "--json").stdout)
    queued += [j["slurm_id"] for j in first["jobs"]]
    assert [j["state"] for j in first["jobs"]] == ["COMPLETED", "FAILED"], proc.stderr[-3000:]
    array_ids = {j["slurm_id"].split("_")[0] for j in first["jobs"]}
    assert len(array_ids) == 1 and all("_" in j["slurm_id"] for j in first["jobs"])  # one array
    logs = switchyard(registry, tmp_path, "logs", "1/1")
    assert "lr=0.3" in logs.stdout and "lr 0.3 diverges" in logs.stdout
    (sweep_dir / "fixed").touch()
    again = switchyard(registry, tmp_path, "resubmit", "1", "--failed", "--json")
    assert again.returncode == 0, again.stderr
    (retry,) = json.loads(again.stdout)["resubmitted"]
    queued.append(retry["slurm_id"])
    slurm_query.wait_for_terminal_states([retry["slurm_id"]], timeout_s=120)
    final = json.loads(switchyard(registry, tmp_path, "status", "1", "--json").stdout)
    assert [(j["state"], j["attempt"]) for j in final["jobs"]] == [("COMPLETED", 1), ("COMPLETED", 2)]


def test_a_run_job_not_waited_for_is_cancelled_by_its_slurm_id(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    proc = switchyard(registry, tmp_path, "run", *TWO_NODES, "cluster.wait=false",
                      f"hydra.run.dir={tmp_path / 'run'}", "--", "sleep", "600")
    job_id = job_id_of(proc, queued)
    assert proc.returncode == 0 and "follow it with switchyard status 1/0" in proc.stdout, proc.stderr
    deadline = time.monotonic() + 120
    while json.loads(switchyard(registry, tmp_path, "status", job_id, "--json").stdout)["jobs"][0]["state"] \
            != "RUNNING":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.5)
    cancelled = switchyard(registry, tmp_path, "cancel", job_id, "--json")
    assert json.loads(cancelled.stdout)["slurm_ids"] == [job_id], cancelled.stderr
    assert slurm_query.wait_for_terminal_states([job_id], timeout_s=60)[job_id] == "CANCELLED"
    (job,) = json.loads(switchyard(registry, tmp_path, "status", "1", "--json").stdout)["jobs"]
    assert job["state"] == "CANCELLED"


def test_dry_run_prints_the_sbatch_script_and_queues_nothing(
        tmp_path: Path, registry: dict[str, str]) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    proc = switchyard(registry, tmp_path, "run", "--dry-run", *TWO_NODES, f"hydra.run.dir={tmp_path / 'run'}",
                      "--", sys.executable, "ddp.py")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --ntasks-per-node=2" in proc.stdout
    assert "--kill-on-bad-exit=1" in proc.stdout and "nothing was queued" in proc.stdout
    # this test runs beside other tests' jobs (queues_nothing): none submitted from its directory,
    # queued or already ended (sbatch's working directory is the submitting one)
    queued = subprocess.run(["squeue", "-h", "-o", "%Z"], capture_output=True, text=True, check=True).stdout
    accounted = subprocess.run(["sacct", "-X", "-n", "-P", "-S", started, "-o", "WorkDir"],
                               capture_output=True, text=True, check=True).stdout
    assert not [d for d in (queued + accounted).split() if d.startswith(str(tmp_path))]
    assert "no sweeps recorded" in switchyard(registry, tmp_path, "status").stdout


@pytest.mark.queues_nothing
def test_a_request_slurm_would_never_start_is_refused_naming_the_key(
        tmp_path: Path, registry: dict[str, str]) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    proc = switchyard(registry, tmp_path, "run", "cluster=slurm", "parallelism.nodes=3",
                      f"hydra.run.dir={tmp_path / 'run'}", "--", sys.executable, "ddp.py")
    assert proc.returncode == 2
    assert "parallelism.nodes=3 but partition debug has 2 node(s) (try parallelism.nodes=2)" in proc.stderr


def test_a_command_killed_by_a_signal_is_named_and_its_retry_avoids_the_node(
        tmp_path: Path, registry: dict[str, str], queued: list[str]) -> None:
    """The rank's Switchyard process outlives its SIGKILLed command and exits with an error, so
    srun saw only an exit code: the point read `exited with status 2`, and its retries went back
    to the same node. Now the report names the signal and resubmit keeps the retry off the node."""
    (tmp_path / "die.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    switchyard(registry, tmp_path, "run", "-m", "cluster=slurm", "parallelism.procs_per_node=1", "+x=1",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", "--", sys.executable, "die.py")
    try:
        (job,) = json.loads(switchyard(registry, tmp_path, "status", "1", "--json").stdout)["jobs"]
        queued.append(job["slurm_id"])
        assert (job["state"], job["exit_code"]) == ("FAILED", 128 + 9), job
        assert "was killed by SIGKILL" in job["error"], job
        again = switchyard(registry, tmp_path, "resubmit", "1", "--failed", "--json")
        assert again.returncode == 0, again.stderr
        (retry,) = json.loads(again.stdout)["resubmitted"]
        queued.append(retry["slurm_id"])
        show = switchyard(registry, tmp_path, "show", "1/0").stdout
        assert f"try 2 avoided {job['node']}: rank 0's command was killed by SIGKILL" in show, show
    finally:
        switchyard(registry, tmp_path, "cancel", "1")
