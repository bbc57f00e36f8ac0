"""SLURM's node launcher (``orchestrator.launch.node_launcher``): the variables each forked rank gets,
how it reports and stops ranks, and that its ranks die with it. Real processes; the job on the real
cluster is in tests/slurm (every ``jobs.train`` there starts its ranks this way)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from process_helpers import running

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import dist_env, fork_start, node_launcher, submit
from orchestrator.launch.bad_nodes import srun_errors
from orchestrator.launch.node_launcher import Layout, Report, supervise

SRUN_ENV = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_CPUS_PER_TASK": "4",
            "SLURMD_NODENAME": "n2", "SLURM_JOB_NODELIST": "n[1-2]"}


def test_a_forked_rank_reads_the_layout_srun_gives_a_started_one() -> None:
    """The launcher is srun's task 1 of 2 (one per node); its second rank is rank 3 of 4."""
    layout = Layout.from_env(SRUN_ENV, per_node=2)
    assert list(layout.ranks) == [2, 3]
    env = {**SRUN_ENV, **layout.rank_env(1)}
    assert env["SLURM_STEP_TASKS_PER_NODE"] == "2(x2)" and env["SLURM_GTIDS"] == "2,3"
    assert env["SLURM_CPUS_PER_TASK"] == "2"  # the launcher holds every rank's CPUs
    seen = dist_env.detect(env)
    assert (seen.rank, seen.local_rank, seen.world_size) == (3, 1, 4)
    assert (seen.local_world_size, seen.node_rank) == (2, 1)


def test_the_sbatch_script_starts_one_launcher_per_node_with_every_ranks_cpus(tmp_path: Path) -> None:
    modules = ("orchestrator.training.rank_process", "torch._dynamo")
    executor = submit.make_executor(ClusterConfig(mode="slurm", cpus_per_task=3),
                                    ParallelismConfig(nodes=2, procs_per_node=2), tmp_path / "submitit",
                                    rank_modules=modules)
    script = submit.sbatch_script(executor)
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --cpus-per-task=3" in script  # the allocation
    folder = tmp_path / "submitit"
    assert (f"--kill-on-bad-exit=1 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=6 "
            f"--output {folder}/%j_%t_launcher.out --error {folder}/%j_%t_launcher.err ") in script
    assert script.rstrip().endswith(f"-u -m orchestrator.launch.node_launcher {folder} 2 "
                                    f"orchestrator.training.rank_process,torch._dynamo")
    spawn = ClusterConfig(mode="slurm", rank_start="spawn")
    started = submit.sbatch_script(submit.make_executor(spawn, ParallelismConfig(nodes=2), folder,
                                                        rank_modules=modules, own_code=True))
    assert "node_launcher" not in started and f"-m orchestrator.launch.job_entry {folder}" in started


def fork_exiting(code: int, delay_s: float = 0.0) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(delay_s)
        os._exit(code)
    return pid


def fork_sleeping(ignore_term: bool = False) -> int:
    pid = os.fork()
    if pid == 0:
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
        os._exit(0)
    return pid


def test_the_first_rank_to_fail_is_reported_in_sruns_words_and_stops_the_others(tmp_path: Path) -> None:
    batch_err = tmp_path / "77_0_log.err"
    report = Report(batch_err, "n2")
    report.started(Layout.from_env(SRUN_ENV, per_node=3), None)
    ranks = {fork_exiting(0): 2, fork_sleeping(): 3, fork_sleeping(ignore_term=True): 4}
    killed = fork_sleeping()
    ranks[killed] = 5
    os.kill(killed, signal.SIGKILL)
    started = time.monotonic()
    code = supervise(ranks, report, grace_s=1.0)
    assert code == 128 + signal.SIGKILL  # srun sees the launcher exit badly and stops the other nodes
    assert time.monotonic() - started < 30  # rank 4, which ignores SIGTERM, got SIGKILL after the grace
    text = batch_err.read_text()
    assert "switchyard launcher: error: n2: task 5: Killed\n" in text
    assert "task 3: Terminated" in text and "task 4: Killed" in text  # stopped: consequences
    assert srun_errors(text + "srun: error: n2: task 1: Exited with exit code 137\n") == [("n2", 5, "Killed")]


def test_ranks_that_all_succeed_leave_the_launcher_silent_and_exiting_zero(tmp_path: Path) -> None:
    report = Report(tmp_path / "77_0_log.err", "n1")
    assert supervise({fork_exiting(0): 0, fork_exiting(0, delay_s=0.2): 1}, report) == 0
    assert not (tmp_path / "77_0_log.err").exists()


def test_a_rank_exiting_with_an_error_code_gives_the_launcher_that_code(tmp_path: Path) -> None:
    report = Report(tmp_path / "77_0_log.err", "n1")
    assert supervise({fork_exiting(3): 0}, report) == 3
    assert srun_errors((tmp_path / "77_0_log.err").read_text()) == [("n1", 0, "Exited with exit code 3")]


def test_a_forked_rank_dies_with_its_launcher(tmp_path: Path) -> None:
    """SIGKILL of the launcher leaves no rank behind to hold its GPU (PR_SET_PDEATHSIG)."""
    read, write = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # the launcher: forks one rank, tells its pid, then waits to be killed
        os.close(read)
        rank = os.fork()
        if rank == 0:
            node_launcher.die_with_parent(os.getppid())
            time.sleep(60)
            os._exit(0)
        os.write(write, str(rank).encode())
        time.sleep(60)
        os._exit(0)
    os.close(write)
    rank = int(os.read(read, 32))
    os.close(read)
    os.kill(launcher, signal.SIGKILL)
    os.waitpid(launcher, 0)
    deadline = time.monotonic() + 10
    while running(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(rank)


@pytest.mark.parametrize("code", [-int(signal.SIGSEGV), 1])
def test_srun_words_for_an_ending(code: int) -> None:
    assert node_launcher.reason(code) == ("Segmentation fault" if code < 0 else "Exited with exit code 1")


def test_a_rank_that_left_on_a_stop_request_stops_nobody(tmp_path: Path) -> None:
    """Preemption: every rank stopped at the same step and exits 255 after the checkpoint; rank 0
    may still be asking `scontrol requeue` when rank 1 has left, and must not be killed for it.
    The launcher then exits 143 (128 + SIGTERM): its 255 read "FAILED 127:0" in sacct."""
    report = Report(tmp_path / "77_0_log.err", "n1")
    slow = fork_exiting(255, delay_s=1.5)
    code = supervise({fork_exiting(255): 1, slow: 0}, report, grace_s=0.1, stopped=lambda rank: True)
    assert code == 143
    text = (tmp_path / "77_0_log.err").read_text()
    assert "stopping" not in text and text.count("Exited with exit code 255") == 2  # rank 0 was not killed


def test_a_rank_that_failed_beside_stopped_ones_gives_its_own_status(tmp_path: Path) -> None:
    report = Report(tmp_path / "77_0_log.err", "n1")
    code = supervise({fork_exiting(255): 0, fork_exiting(3, delay_s=0.5): 1}, report, grace_s=0.1,
                     stopped=lambda rank: rank == 0)
    assert code == 255  # the first that ended: not every rank stopped, so not a clean stop


def test_an_arrays_script_starts_one_launcher_per_node_too(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's points are one array: submitit renders an array's script from a copy of the
    executor, which must be the forking one (a plain copy would start the launcher as every rank).
    The script is caught where sbatch would get it; tests/slurm submits real arrays."""
    from submitit.core import utils

    modules = ("orchestrator.training.rank_process",)
    executor = submit.make_executor(ClusterConfig(mode="slurm"), ParallelismConfig(nodes=2),
                                    tmp_path / "submitit", rank_modules=modules)
    submitted: list[str] = []

    def caught(self: fork_start.ForkingSlurmExecutor, command: str) -> object:
        submitted.append(self._make_submission_file_text(command, uid="x"))
        raise utils.FailedSubmissionError("caught, not queued")

    monkeypatch.setattr(fork_start.ForkingSlurmExecutor, "_submit_command", caught)
    with pytest.raises(utils.FailedSubmissionError):
        executor.map_array(abs, [1, 2])
    [script] = submitted
    assert "#SBATCH --array=0-1" in script and "--ntasks=2 --ntasks-per-node=1" in script
    assert "-m orchestrator.launch.node_launcher" in script
    assert f"--output {tmp_path}/submitit/%A_%a_%t_launcher.out" in script  # %j: the task's own id
