"""GPU jobs on the real scheduler: the local cluster advertises 2 GPUs per node as GRES.

There is no GPU hardware, so each job runs up to the point where torch needs one: SLURM allocates
and binds the GPUs (``--gpus-per-node``, ``CUDA_VISIBLE_DEVICES`` per task), and preflight checks
that binding against a scripted NVML. The training job itself then stops at the real NVML, which
finds no driver, with preflight's message: that proves the whole request went through.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import fake_nvml
import pytest
from fake_nvml import FakeGpu, FakeNvml
from train_helpers import run_train

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import dist_env, slurm_query, submit
from orchestrator.telemetry.preflight import preflight

pytestmark = pytest.mark.slurm

# The probe and the fake NVML travel with the job by value: the nodes import neither tests/ module.
cloudpickle.register_pickle_by_value(fake_nvml)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPUS_PER_NODE = 2


def probe_gpu_rank(gpus_per_node: int) -> dict[str, Any]:
    """Each task: who it is, which GPUs SLURM bound, and what preflight makes of it."""
    env = dist_env.detect()
    node_gpus = FakeNvml([FakeGpu(used=[0], util=[0]) for _ in range(GPUS_PER_NODE)])
    report = preflight(gpus_per_node, env.local_rank, env.local_world_size, nvml=node_gpus)
    return {"rank": env.rank, "local_rank": env.local_rank, "node": env.hostname,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": report.device_index,
            "nvml": report.device_nvml_index}


def run_probe(tmp_path: Path, cluster: ClusterConfig) -> list[dict[str, Any]]:
    parallelism = ParallelismConfig(nodes=2, gpus_per_node=GPUS_PER_NODE)
    executor = submit.make_executor(cluster, parallelism, tmp_path / "submitit")
    job = submit.submit(executor, probe_gpu_rank, GPUS_PER_NODE)
    try:
        return sorted(submit.results(job), key=lambda r: r["rank"])
    finally:
        job.cancel(check=False)  # a no-op once it ended; frees the nodes if it did not


def test_every_rank_sees_its_nodes_gpus_and_takes_its_own(tmp_path: Path) -> None:
    ranks = run_probe(tmp_path, ClusterConfig(mode="slurm"))
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"]
    assert [r["visible"] for r in ranks] == ["0,1"] * 4  # --gpus-per-node=2: every task sees both
    assert [r["cuda"] for r in ranks] == [0, 1, 0, 1]  # so each takes cuda:<local rank>
    assert [r["nvml"] for r in ranks] == [0, 1, 0, 1]


def test_one_gpu_bound_per_task_is_used_as_cuda0(tmp_path: Path) -> None:
    ranks = run_probe(tmp_path, ClusterConfig(mode="slurm", srun_args=["--gpus-per-task=1"]))
    assert [r["visible"] for r in ranks] == ["0", "1", "0", "1"]  # SLURM binds one GPU per task
    assert [r["cuda"] for r in ranks] == [0, 0, 0, 0]  # each rank's only device
    assert [r["nvml"] for r in ranks] == [0, 1, 0, 1]  # and it is a different GPU for each


@pytest.mark.queues_nothing
def test_more_gpus_than_a_node_has_are_refused_at_once() -> None:
    proc = subprocess.run(["srun", "-N1", f"--gpus-per-node={GPUS_PER_NODE + 1}", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr


def test_the_training_job_requests_gpus_and_preflight_stops_without_a_driver(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train("cluster=slurm", "parallelism=gpu", "parallelism.nodes=2",
                     f"parallelism.gpus_per_node={GPUS_PER_NODE}", "optim.max_steps=5",
                     "data.demo_num_samples=256", cache_dir=tmp_path / "cache", run_dir=run_dir)
    job_id = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
    try:
        assert proc.returncode != 0
        assert "parallelism.gpus_per_node=2 but this node has no NVIDIA driver" in proc.stderr
        states = slurm_query.wait_for_terminal_states([job_id], timeout_s=120)
        assert states[job_id] in ("FAILED", "CANCELLED")
        tres = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "AllocTRES"],
                              capture_output=True, text=True, check=True).stdout
        assert "gres/gpu=4" in tres, tres  # 2 nodes x 2 GPUs were allocated to the job
    finally:
        subprocess.run(["scancel", job_id], check=False)
