from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_module
from train_helpers import run_train

from jobs.train import load_config
from orchestrator.config import (
    ClusterConfig,
    ConfigError,
    ParallelismConfig,
    any_model_compile,
    register_configs,
)

register_configs()


def compose_train(*overrides: str):  # type: ignore[no-untyped-def]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_default_is_local_two_ranks() -> None:
    cfg = load_config(compose_train())
    assert cfg.cluster.mode == "local"
    assert cfg.parallelism.world_size == 2


@pytest.mark.parametrize("mode", ["debug", "local", "slurm"])
def test_each_mode_composes(mode: str) -> None:
    assert load_config(compose_train(f"cluster={mode}")).cluster.mode == mode


def test_bad_value_names_key_value_and_fix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(compose_train("parallelism.nodes=0"))
    assert str(info.value) == "parallelism.nodes=0 is invalid: must be >= 1 (try parallelism.nodes=1)"


@pytest.mark.parametrize(("key", "value"), [
    ("partition", "gpu\n#SBATCH --uid=0"), ("account", "a;b"), ("qos", "$(id)"),
    ("job_name", "x`id`"), ("exclude", "n1 n2"), ("comment", "hi\n#SBATCH --x"),
    ("constraint", "a;reboot"),
])
def test_sbatch_values_refuse_injection(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"cluster.{key}=.*sbatch script"):
        ClusterConfig(mode="slurm", **{key: value})


def test_plain_slurm_values_pass() -> None:
    cfg = ClusterConfig(mode="slurm", partition="gpu-a100", account="proj_1", qos="high",
                        constraint="a100&ib", exclude="n[3-4],n7", comment="sweep 12: lr=3e-4")
    assert cfg.partition == "gpu-a100"


def test_srun_args_are_checked_one_by_one() -> None:
    with pytest.raises(ConfigError, match=r"cluster.srun_args\[1\]"):
        ClusterConfig(srun_args=["--cpu-bind=none", "--x;rm"])


def test_nccl_needs_gpus() -> None:
    with pytest.raises(ConfigError, match="nccl needs GPUs"):
        ParallelismConfig(backend="nccl", gpus_per_node=0)


def test_tasks_per_node_is_gpus_or_processes() -> None:
    assert ParallelismConfig(nodes=2, gpus_per_node=4).world_size == 8
    assert ParallelismConfig(nodes=2, gpus_per_node=0, procs_per_node=3).world_size == 6


def test_cfg_job_prints_the_resolved_config_without_running() -> None:
    proc = run_train("--cfg", "job", "model=transformer", "optim.lr=0.01", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "_target_: jobs.models.RowTransformer" in proc.stdout and "lr: 0.01" in proc.stdout
    assert "run_dir:" not in proc.stdout  # printing the config submits nothing


@pytest.mark.parametrize(("override", "said"), [
    ("model.hidden_dim=0", "model.hidden_dim=0 is invalid: a model's widths and head counts must be >= 1 "
                           "(try model.hidden_dim=64)"),
    ("model=gpt model.d_model=0", "model.d_model=0 is invalid: a model's widths and head counts must be "
                                  ">= 1 (try model.d_model=128)"),
    ("model=transformer model.num_heads=0", "model.num_heads=0 is invalid: a model's widths and head "
                                            "counts must be >= 1 (try model.num_heads=4)"),
    ("model.num_layers=-1", "model.num_layers=-1 is invalid: must be >= 0 (0: no blocks) (try "
                            "model.num_layers=2)"),
], ids=["mlp-hidden_dim", "gpt-d_model", "transformer-num_heads", "num_layers"])
def test_a_zero_width_model_is_refused_naming_the_key(override: str, said: str) -> None:
    """``model.hidden_dim=0`` built a model of zero width that trained to exit 0."""
    with pytest.raises(ConfigError) as info:
        load_config(compose_train(*override.split()))
    assert str(info.value) == said


def test_model_compile_is_set_for_any_model_as_for_the_built_ins() -> None:
    """``model.compile=true`` with ``model=custom`` was Hydra's "Key 'compile' is not in struct":
    only ``+model.compile=true`` worked, though every model takes the key. Through
    ``python -m jobs.train`` (``--cfg job``: composed and printed, nothing run)."""
    for model in ("model=custom model._target_=jobs.models.GPT", "model=gpt"):
        proc = run_train("--cfg", "job", *model.split(), "task=causal_lm", "model.compile=true",
                         "model.compile_backend=aot_eager", timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "compile: true" in proc.stdout and "compile_backend: aot_eager" in proc.stdout, proc.stdout
    assert any_model_compile(["model.compile=true", "+model.width=3", "model.compile_mode=default",
                              "optim.lr=1", "+model.compile_dynamic=true"]) == [
        "++model.compile=true", "+model.width=3", "++model.compile_mode=default", "optim.lr=1",
        "+model.compile_dynamic=true"]


@pytest.mark.parametrize("arg", ["--ntasks=1", "-n1", "-n", "-N2", "--nodes=1", "--ntasks-per-node=1",
                                 "--ntasks-per-n=1", "--gpus=1", "--gpus-per-node=1", "-G1",
                                 "--gpus-per-task=2", "--gres=gpu:1", "--cpus-per-task=2", "-c2",
                                 "--mem=1G", "--mem-per-cpu=100", "--distribution=cyclic", "-mcyclic",
                                 "--overcommit", "-O", "--nodelist=n1", "-wn1", "--exclude=n2",
                                 "--kill-on-bad-exit=0", "--output=x.log"])
def test_srun_args_that_set_the_job_steps_shape_are_refused(arg: str) -> None:
    """Issue 27: srun_args=["--ntasks=1"] ran one rank of a world the config said was larger."""
    with pytest.raises(ConfigError, match=r"cluster.srun_args\[1\]=.* is invalid: Switchyard sets --"):
        ClusterConfig(srun_args=["--cpu-bind=none", arg])


@pytest.mark.parametrize("arg", ["--cpu-bind=none", "--gpus-per-task=1", "--label", "-l", "--unbuffered",
                                 "--gpu-bind=closest", "--mpi=none", "--exclusive"])
def test_srun_args_that_leave_the_shape_alone_pass(arg: str) -> None:
    assert ClusterConfig(srun_args=[arg]).srun_args == [arg]


@pytest.mark.parametrize(("arg", "fix"), [
    ("--parsable", "Switchyard prints the job id"), ("--wait", "cluster.wait=true"),
    ("--hold", "cluster.dependency="), ("--test-only", "cluster.dry_run=true"), ("--quiet", "drop it"),
    ("--clusters=other", "login node"), ("--pars", "Switchyard prints the job id"),
])
def test_sbatch_args_that_change_sbatchs_own_behaviour_are_refused(arg: str, fix: str) -> None:
    """Issue 27: --wait blocked with cluster.wait=false; with --parsable a queued job was reported
    as 'sbatch refused the job, nothing was queued'."""
    with pytest.raises(ConfigError, match=rf"cluster.sbatch_args\[0\]=.* changes how sbatch itself "
                                          rf"behaves.*\(try .*{re.escape(fix)}"):
        ClusterConfig(sbatch_args=[arg])


def test_an_sbatch_option_given_twice_is_refused() -> None:
    """Issue 27: the second was dropped without a word."""
    with pytest.raises(ConfigError, match=r"cluster.sbatch_args\[2\]='--mail-type=ALL' is invalid: "
                                          r"--mail-type is already given by cluster.sbatch_args\[0\]"):
        ClusterConfig(sbatch_args=["--mail-type=END", "--mail-user=a@b.c", "--mail-type=ALL"])


def test_other_sbatch_args_pass() -> None:
    args = ["--mail-type=END", "--mail-user=a@b.c", "--wait-all-nodes=1", "--exclusive", "--begin=now+60"]
    assert ClusterConfig(sbatch_args=args).sbatch_args == args
