"""The sbatch script a config turns into, pinned by a golden file (as submitit's own record test
pins its script), and the one table of SLURM options (``config.SBATCH_OPTIONS``) reaching each of
its users: a cluster key added to the table is written to the script, refused in
``cluster.sbatch_args`` and named in a refusal, with no second edit anywhere.

Regenerate the golden file after a deliberate change:
``python tests/orchestrator/launch/test_sbatch_options.py --write``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from orchestrator.config import SBATCH_OPTIONS, ClusterConfig, ConfigError, ParallelismConfig, SbatchOption
from orchestrator.launch import slurm_request, submit

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


def script(cluster: ClusterConfig, parallelism: ParallelismConfig) -> str:
    return _make_sbatch_string(command="python -m job", folder="/runs/golden",
                               **submit.slurm_parameters(cluster, parallelism))


def rendered() -> str:
    """Each case's submitit parameters and the script submitit renders from them."""
    parts = []
    for name, (cluster, parallelism) in CASES.items():
        params = submit.slurm_parameters(cluster, parallelism)
        parts.append(f"=== {name}\n{json.dumps(params, sort_keys=True, indent=1)}\n"
                     f"{script(cluster, parallelism)}")
    return "\n".join(parts)


def test_the_sbatch_script_of_each_config_is_unchanged() -> None:
    assert rendered() == GOLDEN.read_text()


# A value other than the default for each key of the table that sets an option.
SAMPLES: dict[str, Any] = {
    "parallelism.nodes": 4, "parallelism.procs_per_node": 5, "parallelism.gpus_per_node": 3,
    "cluster.cpus_per_task": 7, "cluster.timeout_min": 90, "cluster.mem_gb": 2.0,
    "cluster.partition": "sample", "cluster.account": "sample", "cluster.qos": "sample",
    "cluster.constraint": "sample", "cluster.exclude": "n9", "cluster.comment": "sample",
    "cluster.job_name": "sample", "cluster.signal_delay_s": 45, "cluster.dependency": "afterok:4",
}
SET_BY_KEYS = [o for o in SBATCH_OPTIONS if o.param is not None]


def test_every_key_of_the_table_has_a_sample() -> None:
    """So the test below covers a key added to the table (add its sample here)."""
    assert {k for o in SET_BY_KEYS for k in (o.key, o.gpu_key) if k} == set(SAMPLES)


def configured(key: str) -> tuple[ClusterConfig, ParallelismConfig]:
    group, _, name = key.partition(".")
    cluster, parallelism = ClusterConfig(mode="slurm"), ParallelismConfig()
    if group == "cluster":
        return dataclasses.replace(cluster, **{name: SAMPLES[key]}), parallelism
    return cluster, dataclasses.replace(parallelism, **{name: SAMPLES[key]})


@pytest.mark.parametrize("option", SET_BY_KEYS, ids=lambda o: o.option)
def test_each_key_of_the_table_is_written_and_named_in_refusals(option: SbatchOption) -> None:
    """Its key's value reaches the script (``submit.slurm_parameters``), and a refusal of that
    value names the key (``slurm_request.config_keys``)."""
    default = script(ClusterConfig(mode="slurm"), ParallelismConfig()).splitlines()
    for key in filter(None, (option.key, option.gpu_key)):
        cluster, parallelism = configured(key)
        written = [line for line in script(cluster, parallelism).splitlines()
                   if line.startswith(f"#SBATCH --{option.option}=")]
        assert len(written) == 1 and written[0] not in default, (key, written)
        assert slurm_request.config_keys(parallelism)[str(option.param)] == key


@pytest.mark.parametrize("option", SBATCH_OPTIONS, ids=lambda o: o.option)
def test_each_option_of_the_table_is_refused_in_sbatch_args(option: SbatchOption) -> None:
    """Switchyard writes it, so cluster.sbatch_args may not, and the error names the key to use."""
    with pytest.raises(ConfigError, match=rf"writes --{option.option} itself, from {re.escape(option.key)}"):
        ClusterConfig(sbatch_args=[f"--{option.option}=1"])


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(rendered())
