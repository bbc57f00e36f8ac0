"""Which node a failed attempt leaves behind: a node failure, a rank killed by a signal, a CUDA or
NCCL error at the end of a rank's log; never a rank that exited with an error of its own."""

from __future__ import annotations

from pathlib import Path

from orchestrator.launch.bad_nodes import BadNode, exclude_list, from_logs, of_attempt, srun_errors

KILLED = ("srun: error: n2: task 1: Killed\n"
          "slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2026-11-25T05:00:00 ***\n"
          "srun: launch/slurm: _step_signal: Terminating StepId=12.0\n"
          "srun: error: n1: task 0: Killed\n")  # after Terminating: srun stopped it, a consequence


def test_a_rank_killed_by_a_signal_blames_its_node_and_not_the_ones_srun_stopped() -> None:
    assert from_logs("FAILED", ["n1", "n2"], KILLED, {}) == [
        BadNode("n2", "rank 1 was killed by a signal (srun: Killed)")]


def test_a_rank_that_exited_with_an_error_blames_no_node() -> None:
    stderr = "srun: error: n2: task 0: Exited with exit code 1\n"
    logs = {0: ("n2", "Traceback ...\nValueError: my bug\n")}
    assert from_logs("FAILED", ["n2"], stderr, logs) == []


def test_a_node_failure_blames_the_jobs_nodes() -> None:
    assert from_logs("NODE_FAIL", ["n1"], "", {}) == [
        BadNode("n1", "node failure (SLURM ended the job NODE_FAIL)")]


def test_a_cuda_error_in_a_ranks_log_tail_blames_its_node_but_a_device_assert_or_lost_peer_does_not() -> None:
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    logs = {0: ("n1", "step 3\n" + ecc + "\n"),
            1: ("n2", "RuntimeError: CUDA error: device-side assert triggered\n"),
            2: ("n3", "torch.distributed.DistBackendError: NCCL error: remote process exited or there "
                      "was a network error\n")}
    assert from_logs("FAILED", ["n1", "n2", "n3"], "srun: error: n1: task 0: Exited with exit code 1\n",
                     logs) == [BadNode("n1", f"rank 0's log ends with a CUDA/NCCL error: {ecc}")]


def test_of_attempt_reads_an_array_tasks_submitit_logs(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"40_3_{rank}_log.out").write_text(
            f"switchyard: rank {rank}/2 on node n2 (local rank {rank}, job 40_3, pid 9)\n")
    (tmp_path / "40_3_0_log.err").write_text("srun: error: n2: task 0: Segmentation fault\n")
    (tmp_path / "41_3_0_log.err").write_text("srun: error: n1: task 0: Killed\n")  # another job
    assert of_attempt(tmp_path, "40_3", "FAILED", "n2") == [
        BadNode("n2", "rank 0 was killed by a signal (srun: Segmentation fault)")]


def test_the_exclude_list_keeps_the_users_own() -> None:
    assert exclude_list("gpu[01-02]", ["n2"]) == "gpu[01-02],n2"
    assert exclude_list(None, ["n2", "n1"]) == "n2,n1"
    assert exclude_list(None, []) is None


def test_a_switchyard_run_command_killed_by_a_signal_blames_its_node_as_srun_would() -> None:
    """The rank's Switchyard process survives its command and exits 1 (srun: an exit code), so
    only its own report says a signal ended the rank; a rank killed after another had failed, or
    stopped by SIGTERM, is not the node's doing."""
    stderr = "srun: error: n2: task 0: Exited with exit code 1\n"
    logs = {0: ("n2", "RankFailed: rank 0 on node n2: `python x.py` was killed by SIGKILL (the OOM killer: "
                      "its memory cgroup counted an oom_kill)\nits stderr is empty\n"),
            1: ("n1", "rank 1 on node n1: `python x.py` was killed by SIGKILL after rank 0 had failed\n"),
            2: ("n3", "rank 2 on node n3: `python x.py` was killed by SIGTERM\n")}
    assert from_logs("FAILED", ["n1", "n2", "n3"], stderr, logs) == [
        BadNode("n2", "rank 0's command was killed by SIGKILL (the OOM killer: its memory cgroup counted "
                      "an oom_kill)")]


# What a 2-node job of forked ranks leaves in the batch script's stderr (node_launcher): rank 3,
# forked on n2, was killed; its launcher said so in srun's words, stopped rank 2, and exited 137,
# which srun then reported for its task 1, the launcher (not rank 1).
LAUNCHED = ("switchyard launcher: node n1 (task 0) runs ranks 0-1, forked after one import\n"
            "switchyard launcher: node n2 (task 1) runs ranks 2-3, forked after one import\n"
            "switchyard launcher: error: n2: task 3: Killed\n"
            "switchyard launcher: stopping the other ranks of node n2 after rank 3 ended\n"
            "switchyard launcher: error: n2: task 2: Exited with exit code 1\n"
            "srun: error: n2: task 1: Exited with exit code 137\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=12.0\n"
            "srun: error: n1: task 0: Terminated\n")


def test_a_forked_rank_killed_is_read_from_its_launcher_and_sruns_line_for_the_launcher_is_not() -> None:
    assert srun_errors(LAUNCHED) == [("n2", 3, "Killed")]
    assert from_logs("FAILED", ["n1", "n2"], LAUNCHED, {}) == [
        BadNode("n2", "rank 3 was killed by a signal (srun: Killed)")]


def test_a_launcher_killed_outright_names_every_rank_of_its_node() -> None:
    """A SIGKILLed launcher says nothing; its ranks died with it (PR_SET_PDEATHSIG)."""
    stderr = LAUNCHED.split("switchyard launcher: error")[0] + "srun: error: n2: task 1: Killed\n"
    assert srun_errors(stderr) == [("n2", 2, "Killed"), ("n2", 3, "Killed")]


def test_without_launchers_srun_tasks_are_ranks() -> None:
    assert srun_errors("srun: error: n1: tasks 0,2-3: Exited with exit code 1\n") == [
        ("n1", 0, "Exited with exit code 1"), ("n1", 2, "Exited with exit code 1"),
        ("n1", 3, "Exited with exit code 1")]
