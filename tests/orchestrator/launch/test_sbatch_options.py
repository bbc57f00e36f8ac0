"""The sbatch script a config turns into, pinned by a golden file (as submitit's own record test
pins its script), and the one table of SLURM options (``config.SBATCH_OPTIONS``) reaching each of
its users: a cluster key added to the table is written to the script, refused in
``cluster.sbatch_args`` and named in a refusal, with no second edit anywhere.

Regenerate the golden file after a deliberate change:
``python tests/orchestrator/launch/test_sbatch_options.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from submitit.slurm.slurm import _make_sbatch_string

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import submit

GOLDEN = Path(__file__).with_name("data") / "sbatch_scripts.golden"

CASES: dict[str, tuple[ClusterConfig, ParallelismConfig]] = {
    "defaults on CPU": (ClusterConfig(mode="slurm"), ParallelismConfig()),
    "every key on GPU": (
        ClusterConfig(mode="slurm", job_name="golden", partition="gpu", account="lab", qos="high",
                      constraint="a100&ib", exclude="n[3-4]", comment="nightly run", timeout_min=240,
                      mem_gb=64.5, cpus_per_task=6, signal_delay_s=300, setup=["module load cuda"],
                      srun_args=["--gpus-per-task=1"], sbatch_args=["--mail-type=END", "--exclusive"],
                      dependency="afterok:12"),
        ParallelismConfig(nodes=2, gpus_per_node=8)),
    "three CPU nodes, a dependency alone": (
        ClusterConfig(mode="slurm", mem_gb=0.5, dependency="singleton"),
        ParallelismConfig(nodes=3, procs_per_node=4)),
}


def rendered() -> str:
    """Each case's submitit parameters and the script submitit renders from them."""
    parts = []
    for name, (cluster, parallelism) in CASES.items():
        params = submit.slurm_parameters(cluster, parallelism)
        script = _make_sbatch_string(command="python -m job", folder="/runs/golden", **params)
        parts.append(f"=== {name}\n{json.dumps(params, sort_keys=True, indent=1)}\n{script}")
    return "\n".join(parts)


def test_the_sbatch_script_of_each_config_is_unchanged() -> None:
    assert rendered() == GOLDEN.read_text()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(rendered())
