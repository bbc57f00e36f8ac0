"""Attached launches without SLURM (torchrun), one run per run directory, and the units behind them:
detection, the launch's shape against the config, and the sbatch pass-through rules."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_helpers import run_train, train_command

from orchestrator.config import ClusterConfig, ConfigError, ParallelismConfig
from orchestrator.launch import attach, dist_env, local_jobs, run_lock, submit

SMALL = ["optim.max_steps=20", "data.demo_num_samples=512", "data.batch_size=16", "telemetry.enabled=false"]
SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "85", "SLURMD_NODENAME": "n1"}


def test_torchrun_standalone_is_one_job_of_two_ranks_and_a_refused_resume_is_one_line(tmp_path: Path) -> None:
    """Before: each torchrun worker submitted a 2-rank local job of its own (two jobs, 4 ranks).
    Issue 27: a resume refused on every rank printed the refusal as a traceback from each."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2",
         "-m", "jobs.train", *SMALL, f"data.cache_dir={tmp_path / 'cache'}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = (tmp_path / "outputs" / "attached").glob("torchrun-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(set(summary["param_checksum_per_rank"])) == 1
    assert proc.stdout.count("summary: ") == 1 and not (run_dir / "submitit").exists()

    refused = torchrun(tmp_path, "optim.name=sgd", run_dir=run_dir)  # its checkpoint's optimizer is adamw
    _, err = refused.communicate(timeout=300)
    assert refused.returncode != 0
    assert err.count("error: cannot resume from ") == 1, err[-3000:]
    assert "optim.name: checkpoint 'adamw', now 'sgd'" in err
    assert "CheckpointError" not in err and "exitcode: 2" in err, "one line, exit 2, no rank's traceback"


def test_a_second_run_in_a_busy_run_directory_is_refused_before_submission(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ("data.demo_num_samples=512", "data.batch_size=16")
    first = subprocess.Popen(train_command(*common, "optim.max_steps=1000000", cache_dir=tmp_path / "cache",
                                           run_dir=run_dir),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # the first run's rank 0 holds the lock once it trains
        second = run_train(*common, "optim.max_steps=5", cache_dir=tmp_path / "cache", run_dir=run_dir,
                           timeout=120)
        assert first.poll() is None, "the first run must be unaffected"
    finally:
        first.terminate()
        first.wait(timeout=120)
        for log in (run_dir / "submitit").glob("*_0_log.out"):  # its ranks outlive the submitter
            local_jobs.kill(int(log.name.split("_")[0]))
    assert second.returncode == 2
    assert f"error: hydra.run.dir='{run_dir}' is in use by job " in second.stderr
    assert "(rank 0, pid " in second.stderr
    jobs = {f.name.split("_")[0] for f in (run_dir / "submitit").iterdir() if f.name[0].isdigit()}
    assert len(jobs) == 1, f"the second run queued a job: {jobs}"


def test_the_lock_is_free_again_once_its_holder_is_gone(tmp_path: Path) -> None:
    with run_lock.hold(tmp_path, "job 1 (rank 0)"), \
            pytest.raises(run_lock.RunDirInUseError, match=r"in use by job 1 \(rank 0\)"):
        run_lock.check_free(tmp_path)
    run_lock.check_free(tmp_path)
    with run_lock.hold(tmp_path, "job 2 (rank 0)"):
        pass


@pytest.mark.parametrize(("environ", "attached"), [
    (SRUN_TASK, True),
    ({**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_PROCID": "0"}, False),
    ({"TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, True),
    ({**SRUN_TASK, "SUBMITIT_FOLDER": "/x"}, False),  # submitit's own SLURM task
    ({"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_LOCALID": "0", "SUBMITIT_LOCAL_NTASKS": "2",
      "SUBMITIT_LOCAL_JOB_ID": "9"}, False),
    ({**SRUN_TASK, dist_env.IN_JOB_ENV: "1"}, False),  # a sweep point's task
    ({}, False),
])
def test_attached_launches_are_detected(environ: dict[str, str], attached: bool) -> None:
    assert (dist_env.attached_launch(environ) is not None) == attached


def test_every_rank_names_the_launch_alike() -> None:
    assert dist_env.launch_name(SRUN_TASK) == "slurm-85-step0"
    assert dist_env.launch_name({**SRUN_TASK, "SLURM_PROCID": "3", "SLURM_NODEID": "1"}) == "slurm-85-step0"
    assert dist_env.launch_name({}) is None


def test_the_launch_decides_the_shape_and_an_explicit_contradiction_is_refused() -> None:
    launch = dist_env.attached_launch(SRUN_TASK)
    assert launch is not None
    fitted = attach.fit_to_launch(ParallelismConfig(), launch, set(), "srun (job 85)")
    assert (fitted.nodes, fitted.procs_per_node, fitted.world_size) == (2, 2, 4)
    gpus = attach.fit_to_launch(ParallelismConfig(gpus_per_node=8), launch, set(), "srun (job 85)",
                                visible_gpus=2)
    assert gpus.gpus_per_node == 2
    with pytest.raises(ConfigError, match=r"parallelism.nodes=1 contradicts the launch: srun \(job 85\) "
                                          r"started 2 node\(s\) \(try parallelism.nodes=2"):
        attach.fit_to_launch(ParallelismConfig(), launch, {"parallelism.nodes"}, "srun (job 85)")
    with pytest.raises(ConfigError, match=r"parallelism.gpus_per_node=8 contradicts the launch: .* 2 "
                                          r"task\(s\) on node n1"):
        attach.fit_to_launch(ParallelismConfig(gpus_per_node=8), launch,
                             attach.explicit_keys(["parallelism.gpus_per_node=8"]), "srun (job 85)")


@pytest.mark.parametrize(("arg", "why"), [
    ("--time=5", "Switchyard writes --time itself, from cluster.timeout_min"),
    ("--nodes=3", "Switchyard writes --nodes itself, from parallelism.nodes"),
    ("--output=/tmp/x", "Switchyard writes --output itself"),
    ("-N2", "long form"),
    ("--mail-user=a;touch /tmp/pwned", "shell metacharacters"),
    ("--comment=a\n#SBATCH --x", "shell metacharacters"),
])
def test_sbatch_args_refusals_name_the_reason(arg: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"cluster.sbatch_args\\[0\\]=.* is invalid: .*{why}"):
        ClusterConfig(mode="slurm", sbatch_args=[arg])


@pytest.mark.parametrize("dependency", ["afterok:12", "afterany:12:13,afternotok:14_2", "singleton",
                                        "afterok:12?afterok:13", "after:12+5"])
def test_sbatch_dependencies_that_sbatch_takes_pass(dependency: str) -> None:
    ClusterConfig(mode="slurm", dependency=dependency)


@pytest.mark.parametrize("dependency", ["afterok", "afterok:x", "12", "afterok:12;rm", "before:12"])
def test_malformed_dependencies_are_refused(dependency: str) -> None:
    with pytest.raises(ConfigError, match=r"cluster.dependency=.* is invalid: not an sbatch dependency"):
        ClusterConfig(mode="slurm", dependency=dependency)


def test_pass_through_options_reach_the_script(tmp_path: Path) -> None:
    cluster = ClusterConfig(mode="slurm", sbatch_args=["--mail-type=END,FAIL", "--exclusive"],
                            dependency="afterok:12")
    executor = submit.make_executor(cluster, ParallelismConfig(), tmp_path)
    script = submit.sbatch_script(executor)
    for line in ("#SBATCH --mail-type=END,FAIL", "#SBATCH --exclusive", "#SBATCH --dependency=afterok:12"):
        assert line in script.splitlines()


def test_dry_run_is_for_slurm_only() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.dry_run=True is invalid"):
        ClusterConfig(mode="local", dry_run=True)


@pytest.mark.parametrize(("visible", "fits"), [(1, True), (2, True), (8, True), (0, False)])
def test_each_task_needs_a_gpu_of_its_own(visible: int, fits: bool) -> None:
    """--gpus-per-task=1 (1 each) or --gpus-per-node (all of them) fit; none bound does not."""
    launch = dist_env.attached_launch(SRUN_TASK)
    assert launch is not None
    if fits:
        attach.fit_to_launch(ParallelismConfig(gpus_per_node=2), launch, set(), "srun", visible)
        return
    with pytest.raises(ConfigError, match=r"srun started 2 task\(s\) on node n1 and this task sees no "
                                          r"GPU \(try srun --gpus-per-task=1, or --gpus-per-node=2"):
        attach.fit_to_launch(ParallelismConfig(gpus_per_node=2), launch, set(), "srun", visible)


def test_three_gpus_for_four_tasks_leave_one_without() -> None:
    launch = dist_env.attached_launch({**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NTASKS": "4",
                                       "SLURM_STEP_NUM_NODES": "1"})
    assert launch is not None
    with pytest.raises(ConfigError, match="this task sees 3 GPUs"):
        attach.fit_to_launch(ParallelismConfig(gpus_per_node=4), launch, set(), "srun", 3)


def torchrun(tmp_path: Path, *overrides: str, run_dir: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", "-m",
         "jobs.train", *SMALL, f"data.cache_dir={tmp_path / 'cache'}",
         f"hydra.run.dir={run_dir or tmp_path / 'run'}", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def waiting_pid(beats: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((beats / "rank-0.json").read_text())["pid"])
    return None


def test_a_frozen_rank_under_torchrun_is_named(tmp_path: Path) -> None:
    """Issue 27: the waiting rank printed its gloo timeout as a traceback; the frozen one was
    never named. Now the heartbeats' verdict is printed, as cluster=slurm prints it."""
    proc = torchrun(tmp_path, "optim.max_steps=1000000", "cluster.collective_timeout_s=6")
    beats = tmp_path / "run" / "heartbeat"
    frozen = None
    try:
        deadline = time.monotonic() + 180
        while frozen is None and time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                record = json.loads((beats / "rank-1.json").read_text())
                frozen = int(record["pid"]) if record["step"] >= 3 else None
            time.sleep(0.2)
        if frozen is None:
            proc.kill()
            err = proc.communicate()[1]
            raise AssertionError(f"rank 1 never trained (exit {proc.poll()}):\n{err[-4000:]}")
        waiting = psutil.Process(json.loads((beats / "rank-0.json").read_text())["pid"])
        os.kill(frozen, signal.SIGSTOP)
        waiting.wait(timeout=180)  # rank 0 times out in its collective and exits
        os.kill(frozen, signal.SIGKILL)  # as SLURM would; torchrun's SIGTERM waits on a stopped rank
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        for rank_pid in (p for p in (frozen, waiting_pid(beats)) if p is not None):  # outlive torchrun
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank_pid, signal.SIGKILL)
    report = err[err.index("error: collective timeout"):]
    assert report.startswith("error: collective timeout in torchrun: rank 1 stopped answering"), report
    assert "rank 1: stopped answering: its " in report and f"pid {frozen}" in report
    assert err.count("error: collective timeout") == 1 and "jobs/train.py" not in err, "no rank's traceback"
