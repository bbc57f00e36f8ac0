"""The main job: compose, validate, submit, report.

``python -m jobs.train`` trains the row-pooling MLP on a generated demo dataset with 2 local DDP
ranks; ``cluster=slurm`` puts the same job on SLURM, ``cluster=debug`` runs it in this process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from jobs.demo_data import demo_paths, ensure_demo_dataset
from orchestrator.config import (
    ClusterConfig,
    ConfigError,
    ParallelismConfig,
    TrainConfig,
    register_app_check,
    register_configs,
    unknown_keys,
)
from orchestrator.launch import dist_env, slurm_request, submit
from orchestrator.terminal import printable, refuse_control
from orchestrator.training import trainer
from sharding import DatasetError, open_dataset

register_configs()


def load_config(cfg: DictConfig) -> TrainConfig:
    """DictConfig stops here: build the typed dataclasses, running every group's checks."""
    stray = unknown_keys(cfg)
    if stray:
        raise ConfigError("; ".join(stray))
    try:
        return cast(TrainConfig, OmegaConf.to_object(cfg))
    except MissingMandatoryValue as e:
        key = e.full_key or "a value"
        example = ", e.g. model._target_=my_pkg.models.Net" if key == "model._target_" else ""
        raise ConfigError(f"{key} is missing: it has no default (try {key}=<value> on the command "
                          f"line{example})") from e
    except OmegaConfBaseException as e:
        # OmegaConf wraps errors raised in __post_init__; surface ours without its noise.
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or ConfigError(str(e)) from e


def data_paths(cfg: TrainConfig, generate: bool = False) -> trainer.DataPaths:
    """Where the ranks read; the demo dataset is generated here (once) when ``generate``."""
    if cfg.data.path is None:
        train, evaluation = ensure_demo_dataset(cfg.data) if generate else demo_paths(cfg.data)
        return trainer.DataPaths(train=str(train), eval=str(evaluation))
    evaluation_path = Path(cfg.data.eval_path).expanduser() if cfg.data.eval_path else None
    return trainer.DataPaths(train=str(Path(cfg.data.path).expanduser()),
                             eval=str(evaluation_path) if evaluation_path else None)


def check_before_submit(cfg: TrainConfig) -> trainer.DataPaths:
    """Everything that can fail on the nodes and can be known here, checked here."""
    paths = data_paths(cfg, generate=True)
    in_features = _check_dataset("data.path", paths.train, cfg)
    if paths.eval is not None:
        _check_dataset("data.eval_path", paths.eval, cfg)
    if cfg.checkpoint.dir:
        check_writable_dir("checkpoint.dir", Path(cfg.checkpoint.dir).expanduser())
    with torch.device("meta"):  # builds the model's structure without allocating its weights
        trainer.build_model(cfg.model, in_features, trainer.output_classes(cfg.data), cfg.memory)
    if cfg.cluster.mode == "slurm":
        slurm_request.check(submit.slurm_parameters(cfg.cluster, cfg.parallelism),
                            request_keys(cfg.parallelism))
    if cfg.cluster.mode != "slurm" and cfg.parallelism.gpus_per_node > torch.cuda.device_count():
        raise ConfigError(f"parallelism.gpus_per_node={cfg.parallelism.gpus_per_node} is invalid: this "
                          f"machine has {torch.cuda.device_count()} GPUs (try parallelism.gpus_per_node="
                          f"{torch.cuda.device_count()})")
    return paths


def request_keys(parallelism: ParallelismConfig) -> dict[str, str]:
    """The config keys behind each sbatch value, for an error that names the one to change."""
    tasks = "parallelism.gpus_per_node" if parallelism.gpus_per_node > 0 else "parallelism.procs_per_node"
    return {**slurm_request.CONFIG_KEYS, "ntasks_per_node": tasks}


def check_sweep_point(task_cfg: DictConfig) -> tuple[ClusterConfig, ParallelismConfig]:
    """The sweep launcher runs this on every point before anything is queued (registered below)."""
    typed = load_config(task_cfg)
    check_before_submit(typed)
    return typed.cluster, typed.parallelism


register_app_check(TrainConfig, check_sweep_point)


def check_writable_dir(key: str, path: Path) -> None:
    """``path`` is, or can become, a directory this user writes: known now, not at the first save
    at the end of training. Creates nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it" if existing == path else f"{existing} (on its path)"
        raise ConfigError(f"{key}={str(path)!r} is invalid: {where} is a file, not a directory "
                          f"(try {key}=<a directory>)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r} is invalid: {existing} is not writable by this user "
                          f"(try {key}=<a directory you can write>)")


def _check_dataset(key: str, path: str, cfg: TrainConfig) -> int:
    """Open (cheap: header and sizes) and check the fields; returns the input's feature count."""
    try:
        ds = open_dataset(path)
    except DatasetError as e:
        raise ConfigError(f"{key}={path!r} cannot be opened: {e}") from e
    x, y = cfg.data.input_field, cfg.data.target_field
    fields = ", ".join(f"{n}: {s.dtype}{list(s.shape)}" for n, s in ds.schema.items())
    if x not in ds.schema or len(ds.schema[x].shape) != 2 or not ds.schema[x].dtype.startswith("float"):
        raise ConfigError(f"data.input_field={x!r} is invalid: it must name a float [rows, features] "
                          f"field of {path} (fields: {fields})")
    if y not in ds.schema or ds.schema[y].shape != () or "int" not in ds.schema[y].dtype:
        raise ConfigError(f"data.target_field={y!r} is invalid: it must name an integer scalar "
                          f"field of {path} (fields: {fields})")
    return trainer.feature_count(ds, x)


def run(cfg: TrainConfig, run_dir: Path) -> dict[str, Any] | None:
    if dist_env.inside_launched_job():
        # A sweep point already running as its own SLURM job (every rank runs this): train here.
        # The launcher checked the config and prepared the data before submitting.
        return trainer.train_rank(cfg, data_paths(cfg), str(run_dir))
    print(f"run_dir: {run_dir}", flush=True)
    paths = check_before_submit(cfg)
    executor = submit.make_executor(cfg.cluster, cfg.parallelism, run_dir / "submitit")
    job = submit.submit(executor, trainer.train_rank, cfg, paths, str(run_dir))
    if cfg.cluster.mode == "slurm":
        print(f"slurm_job_id: {job.job_id}\nlogs: {job.paths.folder}", flush=True)
        if not cfg.cluster.wait:
            print(f"not waiting (cluster.wait=false): follow it with squeue -j {job.job_id}")
            return None
        submit.watch_pending(job, cfg.cluster.never_starts)
    summary = submit.results(job, run_dir)[0]
    for warning in summary.get("checkpoint_warnings") or []:  # also in summary.json
        print(f"warning: {warning}", file=sys.stderr)
    if summary.get("resumed_from"):
        print(f"resumed from {summary['resumed_from']['path']} at step {summary['resumed_from']['step']}")
    print(f"summary: {run_dir / 'summary.json'}")
    print(json.dumps({k: summary[k] for k in ("world_size", "steps", "samples_per_rank",
                                              "final_train_loss", "final_eval_loss",
                                              "eval_samples_counted", "wall_s")}))
    return cast(dict[str, Any], summary)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        run(load_config(cfg), Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, submit.JobFailedError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if refused := refuse_control(sys.argv):
        sys.exit(f"error: {refused}")
    main()
