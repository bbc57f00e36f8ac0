"""``switchyard run [OVERRIDES] -- COMMAND...``: the submitting side.

Compose ``conf/run.yaml`` with the overrides (Hydra: the same ``cluster`` and ``parallelism``
groups as ``jobs.train``, ``-m`` sweeps through the same launcher), check what can be checked
here, write the run directory (the command, the resolved config, the environment), submit
:func:`orchestrator.scripts.rank.run_rank` as every rank, record the job in the registry, and wait
for it, failing with the failing rank's name and log tail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from durable import atomic
from orchestrator.config import (
    AppGroups,
    ConfigError,
    omegaconf_error,
    register_app_check,
)
from orchestrator.entry import hydra_app, hydra_task
from orchestrator.launch import (
    container,
    dist_env,
    rank_env,
    signal_delay,
    slurm_request,
    submit,
)
from orchestrator.launch.submission import Plan, Submission
from orchestrator.scripts import rank
from orchestrator.scripts.schema import RunConfig, register_run_configs
from orchestrator.terminal import one_line, printable

APP = "run"


def load_config(cfg: DictConfig) -> RunConfig:
    """DictConfig stops here: the typed RunConfig, every group's checks run."""
    try:
        return cast(RunConfig, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as e:  # OmegaConf wraps errors raised in __post_init__
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or omegaconf_error(e) from e


def spec_of(cfg: RunConfig, run_dir: Path) -> rank.CommandSpec:
    return rank.CommandSpec(argv=list(cfg.command), cwd=cfg.cwd or os.getcwd(),
                            gpus_per_node=cfg.parallelism.gpus_per_node,
                            max_requeues=cfg.cluster.max_requeues,
                            signal_delay_s=signal_delay.submitted_seconds(cfg.cluster, run_dir),
                            rendezvous_timeout_s=cfg.cluster.rendezvous_timeout_s,
                            telemetry=cfg.telemetry.enabled, telemetry_interval_s=cfg.telemetry.interval_s)


# ------------------------------------------------------------------------------------------------
# Before submission


def check_before_submit(cfg: RunConfig) -> None:
    """What would fail on every rank after the queue wait, found here: the command, the
    directory it runs in, the GPUs of this machine (local), and SLURM's verdict (slurm)."""
    check_command(cfg.command, Path(cfg.cwd or os.getcwd()))
    check_resources(cfg)


def check_resources(cfg: RunConfig) -> None:
    """SLURM's verdict on the request (slurm), or this machine's GPUs (local)."""
    if cfg.cluster.mode == "slurm":
        params = submit.slurm_parameters(cfg.cluster, cfg.parallelism)
        slurm_request.check(params, slurm_request.config_keys(cfg.parallelism))
    elif cfg.parallelism.gpus_per_node > 0:
        import torch

        if cfg.parallelism.gpus_per_node > torch.cuda.device_count():
            raise ConfigError(f"parallelism.gpus_per_node={cfg.parallelism.gpus_per_node} is invalid: this "
                              f"machine has {torch.cuda.device_count()} GPUs (try parallelism.gpus_per_node="
                              f"{torch.cuda.device_count()})")


def check_command(argv: Sequence[str], cwd: Path) -> None:
    if not argv:
        raise ConfigError("nothing to run: give the command after `--` (try switchyard run "
                          "cluster=local -- python train.py)")
    if not cwd.is_dir():
        raise ConfigError(f"cwd={str(cwd)!r} is invalid: not a directory (try cwd=null: the "
                          f"directory switchyard run starts in)")
    program = argv[0]
    if "/" in program:
        path = cwd / program
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"the command {program!r} is not an executable file (from {cwd}): every "
                              f"rank would fail to start it (try chmod +x {program}, or name its "
                              f"interpreter first)")
    elif shutil.which(program) is None:
        raise ConfigError(f"the command {program!r} is not found on PATH here, and the ranks inherit "
                          f"this PATH (check its spelling, or give its path)")
    script = argv[1] if _is_python(program) and len(argv) > 1 and not argv[1].startswith("-") else None
    if script is not None and not (cwd / script).is_file():
        raise ConfigError(f"the script {argv[1]!r} does not exist in {cwd}: python would fail on every "
                          f"rank (check the path, or set cwd=<the directory that holds it>)")


def _is_python(program: str) -> bool:
    name = Path(program).name
    return name == "python" or (name.startswith("python")
                                and name.removeprefix("python").replace(".", "").isdigit())


def check_sweep_point(task_cfg: DictConfig) -> AppGroups:
    """The sweep launcher runs this on every point of ``switchyard run -m`` before queueing. Its
    ranks start as processes: each execs the user's command."""
    typed = load_config(task_cfg)
    check_before_submit(typed)
    return AppGroups(typed.cluster, typed.parallelism, own_code=True)


register_app_check(RunConfig, check_sweep_point)


# ------------------------------------------------------------------------------------------------
# Submission


def write_run_files(run_dir: Path, cfg: RunConfig, spec: rank.CommandSpec, config_yaml: str) -> None:
    """RUN/command.sh (what runs, where), RUN/config.yaml (resolved) and RUN/env/submit.json."""
    atomic.write_text(run_dir / "command.sh", f"cd {shlex.quote(spec.cwd)}\n{shlex.join(spec.argv)}\n")
    atomic.write_text(run_dir / "config.yaml", config_yaml)
    atomic.write_json(run_dir / "env" / "submit.json",
                      {"host": socket.gethostname(), "python": sys.executable,
                       "environment": rank_env.environment_record(os.environ, rank.KEPT_ENVIRONMENT)},
                      indent=1)


def run(cfg: RunConfig, run_dir: Path, overrides: Sequence[str], config_yaml: str
        ) -> list[rank.RankResult] | None:
    if dist_env.inside_launched_job():  # a sweep point's task: this process is one rank
        if dist_env.detect().is_main:
            write_run_files(run_dir, cfg, spec_of(cfg, run_dir), config_yaml)
        return [rank.run_rank(spec_of(cfg, run_dir), str(run_dir))]
    submitted = Submission(
        app=APP, command=f"{' '.join(overrides)} -- {shlex.join(cfg.command)}".strip(), run_dir=run_dir,
        cluster=cfg.cluster, parallelism=cfg.parallelism, overrides=overrides,
        check=lambda cluster: plan(dataclasses.replace(cfg, cluster=cluster), run_dir, config_yaml)).run()
    return None if submitted.results is None else report(submitted.results, run_dir)


def plan(cfg: RunConfig, run_dir: Path, config_yaml: str) -> Plan[rank.RankResult]:
    """Each rank runs the command (``rank.run_rank``), a process of its own; debug runs it here."""
    check_before_submit(cfg)
    spec = spec_of(cfg, run_dir)

    def in_process() -> list[rank.RankResult]:
        with rank.redirected_signals():
            return [rank.run_rank(spec, str(run_dir))]

    mounted = [container.Need("cwd", spec.cwd, shared=True),
               *(container.Need("the command's script", p, fix="moving it to a path without ',' or ':'")
                 for p in scripts_of(cfg))]
    return Plan(rank.run_rank, (spec, str(run_dir)), config_yaml, scripts=scripts_of(cfg), mounts=mounted,
                own_code=True, before_submit=lambda: write_run_files(run_dir, cfg, spec, config_yaml),
                in_process=in_process if cfg.cluster.mode == "debug" else None)


def scripts_of(cfg: RunConfig) -> list[Path]:
    """The Python files the command names (``python train.py``): their imports are recorded."""
    cwd = Path(cfg.cwd or os.getcwd())
    return [cwd / arg for arg in cfg.command if arg.endswith(".py") and (cwd / arg).is_file()]


def report(results: list[rank.RankResult], run_dir: Path) -> list[rank.RankResult]:
    """The end, as ``jobs.train`` reports it: where the summary is, and its memory warnings."""
    nodes = sorted({r.node for r in results})
    print(f"done: {len(results)} rank(s) on {', '.join(nodes)} exited 0; summary: {run_dir / 'summary.json'}")
    try:
        memory = json.loads((run_dir / "summary.json").read_text()).get("memory") or {}
    except (OSError, ValueError):
        memory = {}
    for flag in memory.get("flags", []):  # idle GPUs, GPU 0 overload, a rank on another's GPU
        print(f"memory warning: {flag}")
    return results


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="run")
@hydra_task
def hydra_main(cfg: DictConfig) -> None:
    try:
        hydra_cfg = HydraConfig.get()
        typed = load_config(cfg)
        run(typed, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task),
            OmegaConf.to_yaml(cfg, resolve=True))
    except submit.JobStoppedError as e:  # a cancel (or preemption) is not a failure
        print(f"stopped: {printable(e)}", file=sys.stderr)
        sys.exit(submit.STOPPED_EXIT_CODE)
    except ConfigError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except (submit.JobFailedError, rank.CommandFailed) as e:  # with the failing rank's log tail
        if isinstance(e, rank.CommandFailed) and dist_env.inside_launched_job():
            raise  # a sweep point's rank: its report keeps the rank, the command's status and signal
        print(f"error: {printable(e)}", file=sys.stderr)
        sys.exit(2)


def main(overrides: Sequence[str], command: Sequence[str]) -> int:
    """``switchyard run``: Hydra parses ``overrides`` as for ``jobs.train`` (``-m`` included); the
    command reaches the config as ``command``'s default, never through Hydra's override parser."""
    register_run_configs(list(command))
    saved = sys.argv
    sys.argv = ["switchyard run", *overrides]
    try:
        hydra_app(hydra_main, sys.argv, prefix="switchyard run: ")
    finally:
        sys.argv = saved
    return 0
