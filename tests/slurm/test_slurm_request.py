"""A request SLURM can never start is refused before anything is queued, naming the config key and a
value that fits; one that slipped through is reported while pending, and cancelled or kept."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
import submitit
from slurm_fakes import limiting_partition
from train_helpers import refusal as train_refusal
from train_helpers import run_train

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import slurm_query, slurm_request, submit

pytestmark = pytest.mark.slurm


def queued(name: str | None = None) -> list[str]:
    """Job ids in the queue; with ``name``, only this test's (other users queue jobs meanwhile)."""
    by_name = ["-n", name] if name else []
    return subprocess.run(["squeue", "-h", "-o", "%i", *by_name], capture_output=True, text=True,
                          check=True).stdout.split()


def own_name() -> str:
    return f"sy-test-{uuid.uuid4().hex[:12]}"


def refusal(cluster: ClusterConfig, parallelism: ParallelismConfig) -> str:
    name = own_name()
    with pytest.raises(slurm_request.SlurmRequestError) as caught:
        slurm_request.check(submit.slurm_parameters(dataclasses.replace(cluster, job_name=name),
                                                    parallelism), slurm_request.config_keys(parallelism))
    assert queued(name) == [], "a refused request must queue nothing"
    return str(caught.value)


@pytest.mark.parametrize(("cluster", "parallelism", "names"), [
    (ClusterConfig(mode="slurm"), ParallelismConfig(nodes=3),
     ["parallelism.nodes=3", "partition debug has 2 node(s)", "(try parallelism.nodes=2)"]),
    (ClusterConfig(mode="slurm", cpus_per_task=64), ParallelismConfig(),
     ["cluster.cpus_per_task=64 needs 128 CPUs", "has 2", "(try cluster.cpus_per_task=1)"]),
    (ClusterConfig(mode="slurm", mem_gb=100), ParallelismConfig(),
     ["cluster.mem_gb=100", "(try cluster.mem_gb=23)"]),
    (ClusterConfig(mode="slurm"), ParallelismConfig(gpus_per_node=3),
     ["parallelism.gpus_per_node=3", "at most 2 GPUs", "(try parallelism.gpus_per_node=2)"]),
    (ClusterConfig(mode="slurm", partition="nope"), ParallelismConfig(),
     ["cluster.partition='nope' is invalid: no such partition (partitions: debug) "
      "(try cluster.partition=debug)"]),
    (ClusterConfig(mode="slurm", constraint="nosuchfeature"), ParallelismConfig(),
     ["cluster.constraint='nosuchfeature'", "no node of the partition has that feature"]),
])
def test_a_request_that_can_never_start_is_refused_naming_the_key(
        cluster: ClusterConfig, parallelism: ParallelismConfig, names: list[str]) -> None:
    message = refusal(cluster, parallelism)
    for name in names:
        assert name in message, message
    assert "sbatch --test-only said:" in message


def unreachable_controller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM_CONF naming a controller on a port nothing listens on: the real clients, refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort={port}\n"
                    f"AuthType=auth/munge\nNodeName=x1 CPUs=1 State=UNKNOWN\n"
                    f"PartitionName=debug Nodes=x1 Default=YES State=UP\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


DOWN = re.compile(r"^no SLURM controller answers, so nothing was queued: scontrol ping said: "
                  r"Slurmctld\(primary\) at \S+ is DOWN \(this machine's local cluster: switchyard "
                  r"cluster up; elsewhere check that slurmctld runs and that SLURM_CONF names it\)$")


def test_a_controller_that_does_not_answer_is_named_at_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: sbatch --test-only retried for a minute, scontrol show partition for 30 s more, and
    the refusal said "SLURM would never start this job ... no partition limit explains it"."""
    unreachable_controller(tmp_path, monkeypatch)
    with pytest.raises(slurm_request.SlurmRequestError) as caught:
        slurm_request.check(submit.slurm_parameters(ClusterConfig(mode="slurm"), ParallelismConfig()))
    assert DOWN.match(str(caught.value)), str(caught.value)
    # jobs.train says so before its model check and memory estimate (a GPU job's asks sinfo, 30 s)
    said = train_refusal("cluster=slurm", "parallelism=gpu", "parallelism.gpus_per_node=1",
                         f"data.cache_dir={tmp_path / 'cache'}")
    assert DOWN.match(said.removeprefix("error: ")), said


def test_a_time_limit_over_the_partitions_max_time_is_refused_before_sbatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sbatch takes any time limit where the site does not set EnforcePartLimits (this cluster's
    is NO), and the job then pends (PartitionTimeLimit) forever: refused first, from the same one
    ``scontrol show partition`` a refusal reads (this partition's MaxTime, 2 days, as a site's)."""
    log = limiting_partition(tmp_path / "bin", "2-00:00:00")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    said = refusal(ClusterConfig(mode="slurm", timeout_min=2881), ParallelismConfig())
    assert said == ("SLURM would never start this job, so nothing was queued: cluster.timeout_min=2881 but "
                    "partition debug allows at most 2880 minutes (MaxTime=2-00:00:00) (try "
                    "cluster.timeout_min=2880)")
    lines = log.read_text().splitlines()
    assert not [line for line in lines if line.startswith("sbatch")], "refused before sbatch"
    log.unlink()
    slurm_request.check(submit.slurm_parameters(ClusterConfig(mode="slurm", timeout_min=2880),
                                                ParallelismConfig()))
    log.unlink()
    refusal(ClusterConfig(mode="slurm"), ParallelismConfig(nodes=3))  # sbatch refuses: limits read
    asked = [line for line in log.read_text().splitlines() if line.startswith("scontrol show partition")]
    assert len(asked) == 1, "one scontrol show partition per check"


@pytest.mark.parametrize(("override", "said"), [
    ("cluster.timeout_min=99999999999", "error: cluster.timeout_min=99999999999 is invalid: SLURM keeps a "
                                        "time limit of at most 35791393 minutes"),
    ("cluster.job_name=", "error: cluster.job_name='' is invalid: a job needs a name"),
], ids=["timeout-beyond-slurm", "empty-job-name"])
def test_a_time_limit_slurm_cannot_keep_and_an_empty_job_name_are_refused(override: str, said: str) -> None:
    """Both were queued: 99,999,999,999 minutes as a 2,981,813-day limit (SLURM wraps it around),
    and an empty name as the job's script name."""
    line = train_refusal("cluster=slurm", override)
    assert line.startswith(said), line


def test_a_request_that_fits_passes() -> None:
    slurm_request.check(submit.slurm_parameters(ClusterConfig(mode="slurm"), ParallelismConfig(nodes=2)))


def test_the_training_job_refuses_before_queueing(tmp_path: Path) -> None:
    """Before: accepted, PENDING (PartitionNodeLimit) forever, the client silent."""
    name = own_name()
    proc = run_train("cluster=slurm", "parallelism.nodes=3", f"cluster.job_name={name}",
                     cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: SLURM would never start this job, so nothing was queued: "
                                  "parallelism.nodes=3"), proc.stderr
    assert "Traceback" not in proc.stderr and "slurm_job_id" not in proc.stdout
    assert queued(name) == [], "nothing of this test's may be queued"


def test_an_sbatch_refusal_is_one_line(tmp_path: Path) -> None:
    executor = submitit.SlurmExecutor(folder=tmp_path)
    executor.update_parameters(**submit.slurm_parameters(
        ClusterConfig(mode="slurm", constraint="nosuchfeature"), ParallelismConfig()))
    with pytest.raises(submit.SubmissionError, match=r"^sbatch refused the job, nothing was queued: "
                                                     r".*Invalid feature specification"):
        submit.submit(executor, print)


def test_a_percent_in_the_run_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(submit.ConfigError, match=r"holds '%'.*\(try hydra.run.dir="):
        submit.make_executor(ClusterConfig(mode="slurm"), ParallelismConfig(), tmp_path / "a%jb" / "s")


def pending_job(tmp_path: Path) -> submitit.SlurmJob[None]:
    """A job sbatch accepts and SLURM can never start: 3 nodes from a 2-node partition."""
    job_id = subprocess.run(["sbatch", "--parsable", "--nodes=3", "--wrap=true"], capture_output=True,
                            text=True, check=True).stdout.strip()
    return submitit.SlurmJob(folder=tmp_path, job_id=job_id)


@pytest.mark.parametrize("choice", ["cancel", "keep"])
def test_a_job_pending_for_a_reason_it_cannot_meet_is_reported(tmp_path: Path, choice: str) -> None:
    job = pending_job(tmp_path)
    try:
        expected = rf"job {job.job_id} is pending for a reason it can never meet \(Partition\w+\)"
        with pytest.raises(submit.SubmissionError, match=expected):
            submit.watch_pending(job, choice, poll_s=0.5)
        if choice == "cancel":
            states = slurm_query.wait_for_terminal_states([job.job_id], timeout_s=30)
            assert states[job.job_id] == "CANCELLED"
        else:
            assert job.job_id in queued(), "keep leaves the job queued"
    finally:
        subprocess.run(["scancel", job.job_id], check=False)


def sbatch(*args: str) -> str:
    # --output: a job that runs ('exit 1') would leave slurm-N.out in the working directory
    return subprocess.run(["sbatch", "--parsable", "--job-name=sy-test-never", "--output=/dev/null", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("how", ["dependency", "hold", "uhold"])
def test_a_job_that_waits_for_what_never_comes_is_reported_and_cancelled(tmp_path: Path, how: str) -> None:
    """Issue 27: afterok on a failed job (DependencyNeverSatisfied) or a hold (JobHeldUser,
    JobHeldAdmin) kept the client waiting in silence."""
    submitted: list[str] = []
    try:
        if how == "dependency":
            submitted.append(sbatch("--wrap=exit 1"))
            assert slurm_query.wait_for_terminal_states(submitted, timeout_s=60)[submitted[0]] == "FAILED"
            submitted.append(sbatch(f"--dependency=afterok:{submitted[0]}", "--wrap=true"))
            reason = r"DependencyNeverSatisfied\): its dependency \(cluster.dependency\) can never be met"
        else:  # held before it can start (--begin), then held as root (admin) or as its user
            submitted.append(sbatch("--begin=now+600", "--wrap=true"))
            subprocess.run(["scontrol", how, submitted[-1]], check=True)
            reason = r"JobHeld(User|Admin)\): .*held.* scontrol release"
        job = submitit.SlurmJob(folder=tmp_path, job_id=submitted[-1])
        with pytest.raises(submit.SubmissionError, match=rf"job {job.job_id} is pending for a reason it "
                                                         rf"can never meet \({reason}.*; cancelled it"):
            submit.watch_pending(job, "cancel", poll_s=0.5)
        assert slurm_query.wait_for_terminal_states([job.job_id], timeout_s=30)[job.job_id] == "CANCELLED"
    finally:
        subprocess.run(["scancel", *submitted], check=False)


@pytest.mark.parametrize(("text", "minutes"), [("UNLIMITED", None), ("30", 30), ("1-00:00:00", 1440),
                                                ("02:30:00", 150), ("10:30", 11)])
def test_partition_time_limits_parse(text: str, minutes: int | None) -> None:
    assert slurm_request._limit(text, slurm_request._minutes) == minutes


@pytest.mark.parametrize(("gres", "gpus"), [("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("(null)", 0),
                                             ("gpu:2,shard:8", 2)])
def test_gres_gpu_counts_parse(gres: str, gpus: int) -> None:
    assert slurm_request._gpus(gres) == gpus
