from __future__ import annotations

import pytest

from orchestrator.launch.dist_env import DistEnvError, detect, expand_tasks_per_node, first_host

SLURM_STEP = {
    "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
    "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n2",
    "SLURM_RESTART_COUNT": "1",
}


def test_slurm_step_gives_ranks_master_and_restart() -> None:
    env = detect(SLURM_STEP)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.hostname) == (1, 2, "n1", "n2")
    assert (env.job_id, env.restart_count, env.source) == ("42", 1, "slurm")
    assert not env.is_main and not env.is_local_main


def test_array_task_job_id_is_array_and_task() -> None:
    env = detect({**SLURM_STEP, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "7"})
    assert env.job_id == "40_7"


def test_torchrun_wins_over_surrounding_allocation() -> None:
    env = detect({**SLURM_STEP, "TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "LOCAL_RANK": "1",
                  "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
                  "MASTER_PORT": "29555"})
    assert (env.source, env.rank, env.world_size, env.master_port) == ("torchrun", 1, 2, 29555)


def test_submitit_local() -> None:
    env = detect({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1",
                  "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "999"})
    assert (env.source, env.rank, env.world_size, env.job_id) == ("local", 1, 2, "999")


def test_nothing_is_a_single_process() -> None:
    env = detect({})
    assert (env.source, env.rank, env.world_size) == ("single", 0, 1)


def test_missing_variable_is_named() -> None:
    broken = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_NTASKS"}
    with pytest.raises(DistEnvError, match="SLURM_NTASKS"):
        detect(broken)


@pytest.mark.parametrize(("nodelist", "first"), [
    ("n1", "n1"), ("n[1-2]", "n1"), ("gpu[007,009-010]", "gpu007"), ("a[3-4],b1", "a3"),
    ("x-1,x-2", "x-1"), ("rack[2-3]-node", "rack2-node"),
])
def test_first_host(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(DistEnvError):
        expand_tasks_per_node("two")
