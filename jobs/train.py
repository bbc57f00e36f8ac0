"""The main job: compose, validate, submit, report.

``python -m jobs.train`` runs on its built-in default (local mode, 2 ranks); ``cluster=slurm``
puts the same job on SLURM, ``cluster=debug`` runs it in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jobs import smoke
from orchestrator import submit
from orchestrator.config import ConfigError, TrainConfig, register_configs

register_configs()


def load_config(cfg: DictConfig) -> TrainConfig:
    """DictConfig stops here: build the typed dataclasses, running every group's checks."""
    try:
        return cast(TrainConfig, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as e:
        # OmegaConf wraps errors raised in __post_init__; surface ours without its noise.
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or ConfigError(str(e)) from e


def run(cfg: TrainConfig, run_dir: Path) -> list[dict[str, object]]:
    print(f"run_dir: {run_dir}", flush=True)
    executor = submit.make_executor(cfg.cluster, cfg.parallelism, run_dir / "submitit")
    job = submit.submit(executor, smoke.allreduce, str(run_dir / "rendezvous"),
                        backend=cfg.parallelism.backend,
                        rendezvous_timeout_s=cfg.cluster.rendezvous_timeout_s)
    if cfg.cluster.mode == "slurm":
        print(f"slurm_job_id: {job.job_id}\nlogs: {job.paths.folder}", flush=True)
    results = submit.results(job)
    for r in results:
        print(f"rank {r['rank']}/{r['world_size']} on {r['hostname']}: all_reduce -> {r['reduced']}")
    return results


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train_cfg = load_config(cfg)
        run(train_cfg, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, submit.JobFailedError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
