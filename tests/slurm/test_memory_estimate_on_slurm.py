"""The memory estimate on the SLURM cluster: the dry run prints its table, and a step too large for
``cluster.gpu_mem_gb`` is refused before sbatch is asked anything, naming an option that fits."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from train_helpers import run_train

pytestmark = [pytest.mark.slurm, pytest.mark.queues_nothing]  # dry runs and refusals

SMALL = ["model=transformer", "data.demo_num_samples=256", "data.batch_size=32", "telemetry.enabled=false"]


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_train("cluster=slurm", "parallelism=gpu", *SMALL, "cluster.dry_run=true", *overrides,
                     cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")


def test_the_dry_run_prints_the_estimate_as_a_table(tmp_path: Path) -> None:
    proc = train(tmp_path, "parallelism.gpus_per_node=1", "cluster.gpu_mem_gb=16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout[proc.stdout.index("| memory per rank (estimate) | size |"):]
    for row in ("parameters", "gradients", "optimizer", "activations", "temporary", "peak"):
        assert re.search(rf"^\| {row} \| [\d.]+ MiB \|$", table, re.MULTILINE), table
    assert "| share of 16.0 GiB on cluster.gpu_mem_gb=16 | 0% |" in table


def test_a_step_over_the_gpu_is_refused_naming_an_option_whose_estimate_fits(tmp_path: Path) -> None:
    # 9.2 MiB per GPU; the step needs about 11. 2 GPUs per node: what the cluster's nodes have.
    proc = train(tmp_path, "cluster.gpu_mem_gb=0.009", "parallelism.gpus_per_node=2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"error: memory: the estimated peak is ([\d.]+) MiB per rank, above 95% of the "
                         r"9\.2 MiB of cluster\.gpu_mem_gb=0\.009: the first step would run out of memory, "
                         r"so nothing was queued; the cheapest option that fits: (.+), estimated at "
                         r"([\d.]+) MiB \((\d+)%\) \(try (.+), or memory\.estimate=warn to submit anyway\)",
                         error)
    assert found, error
    assert float(found.group(1)) > 9.2 * 0.95 and float(found.group(3)) <= 9.2 * 0.95
    assert int(found.group(4)) <= 95 and found.group(2) == found.group(5) == "memory.amp=bf16"
    named = train(tmp_path, "cluster.gpu_mem_gb=0.009", "parallelism.gpus_per_node=2", found.group(5))
    assert named.returncode == 0, named.stderr[-2000:]  # the option's own estimate passes the check
