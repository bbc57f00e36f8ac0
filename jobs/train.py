"""The main job: compose, validate, submit, report.

``python -m jobs.train`` trains the row-pooling MLP on a generated demo dataset with 2 local DDP
ranks; ``cluster=slurm`` puts the same job on SLURM, ``cluster=debug`` runs it in this process.
"""

from __future__ import annotations

import os
import sys

from orchestrator.launch import fork_safety

try:  # first: below torch's floor, the first newer import would be a traceback, not one line
    # torch's import (numpy's OpenBLAS) starts a thread pool unless told 1: this process forks its
    # local job's controller (fork_start.ControllerTemplate), and a fork leaves threads behind. Its
    # own work is light; a rank sets its own threads (runtime.thread_budget), in debug mode too.
    _HELD = fork_safety.hold_thread_pools()
    import orchestrator.training  # noqa: F401 -- checks torch's version on import
except ImportError as e:
    if e.name != "torch":
        raise
    from orchestrator.launch.container import inside_image  # a rank in an image without torch

    sys.exit(f"error: {e}{inside_image(os.environ)}")

import dataclasses
import json
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from jobs.demo_data import demo_paths, ensure_demo_dataset
from orchestrator.config import (
    AppGroups,
    ConfigError,
    TrainConfig,
    any_model_compile,
    omegaconf_error,
    register_app_check,
    register_configs,
    unknown_keys,
)
from orchestrator.entry import hydra_app, hydra_task
from orchestrator.launch import (
    attach,
    container,
    dist_env,
    fork_start,
    ownership,
    provenance,
    rendezvous,
    single,
    snapshot,
    submit,
)
from orchestrator.launch.submission import Plan, Submission
from orchestrator.quick_exit import exit_now
from orchestrator.terminal import one_line, printable
from orchestrator.training import checks, estimate, rank_process, resume, trainer
from orchestrator.training.checkpoint import CheckpointError
from orchestrator.training.stragglers import Straggler

register_configs()
if _HELD:
    fork_safety.restore_thread_vars()  # for the processes started from here


def run_stamp(default: str) -> str:
    """``hydra.run.dir``'s leaf: the time, or for an attached launch a name all its ranks share
    (their clocks may disagree on the second) and a requeue of the same job finds again."""
    name = dist_env.launch_name()
    return f"attached/{name}" if name else default


OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)


def load_config(cfg: DictConfig) -> TrainConfig:
    """DictConfig stops here: build the typed dataclasses, running every group's checks."""
    try:
        stray = unknown_keys(cfg)  # reads every value: an interpolation that fails, fails here
        if stray:
            raise ConfigError("; ".join(stray))
        return cast(TrainConfig, OmegaConf.to_object(cfg))
    except MissingMandatoryValue as e:
        key = e.full_key or "a value"
        example = ", e.g. model._target_=my_pkg.models.Net" if key == "model._target_" else ""
        raise ConfigError(f"{key} is missing: it has no default (try {key}=<value> on the command "
                          f"line{example})") from e
    except OmegaConfBaseException as e:
        # OmegaConf wraps errors raised in __post_init__; surface ours without its noise.
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or omegaconf_error(e) from e


def data_paths(cfg: TrainConfig, generate: bool = False) -> trainer.DataPaths:
    """Where the ranks read; the demo dataset is generated here (once) when ``generate``."""
    if cfg.data.path is None:
        train, evaluation = ensure_demo_dataset(cfg.data) if generate else demo_paths(cfg.data)
        return trainer.DataPaths(train=str(train), eval=str(evaluation))
    evaluation_path = Path(cfg.data.eval_path).expanduser() if cfg.data.eval_path else None
    return trainer.DataPaths(train=str(Path(cfg.data.path).expanduser()),
                             eval=str(evaluation_path) if evaluation_path else None)


def check_before_submit(cfg: TrainConfig, run_dir: Path | None = None
                        ) -> tuple[trainer.DataPaths, estimate.MemoryReport | None]:
    """Everything that can fail on the nodes and can be known here (``training.checks``), after
    the demo dataset is generated if it is the one trained on; and the step's memory estimate.
    ``run_dir``: the resume its ranks would make is checked too."""
    paths = data_paths(cfg, generate=True)
    return paths, checks.check_before_submit(cfg, paths, run_dir)


def container_paths(cfg: TrainConfig, paths: trainer.DataPaths, run_dir: Path) -> list[container.Need]:
    """What the ranks read and write outside the run directory, mounted into ``cluster.container``'s
    image (``orchestrator.launch.container``). The checkpoint directory is made at submission, to
    be mounted at its own path (a dry run makes nothing); the demo dataset's cache, when it is the
    one trained on, was made when the dataset was generated."""
    if cfg.cluster.container.runtime == "none":
        return []
    demo_cache = cfg.data.cache_dir if cfg.data.path is None else None
    return [container.Need("data.path", paths.train), container.Need("data.eval_path", paths.eval),
            container.Need("data.cache_dir", demo_cache),
            container.Need("checkpoint.dir", resume.checkpoint_dir(cfg, run_dir), made=True),
            container.Need("checkpoint.resume_from", cfg.checkpoint.resume_from)]


def check_sweep_point(task_cfg: DictConfig) -> AppGroups:
    """The sweep launcher runs this on every point before anything is queued (registered below)."""
    typed = load_config(task_cfg)
    check_before_submit(typed)  # a point that would not fit its GPU is refused here
    return AppGroups(typed.cluster, typed.parallelism, rank_process.rank_modules(typed), own_code=True)


register_app_check(TrainConfig, check_sweep_point)


def run(cfg: TrainConfig, run_dir: Path, overrides: Sequence[str] = ()) -> dict[str, Any] | None:
    if dist_env.inside_launched_job():
        # A sweep point already running as its own SLURM job (every rank runs this): train here.
        # The launcher checked the config and prepared the data before submitting.
        return rank_process.train_rank(cfg, data_paths(cfg), str(run_dir))
    launch = dist_env.attached_launch()
    if launch is not None:
        return run_attached(cfg, run_dir, launch, overrides)
    submitted = Submission(
        app="train", command=" ".join(overrides), run_dir=run_dir, cluster=cfg.cluster,
        parallelism=cfg.parallelism, overrides=overrides,
        check=lambda cluster: plan(dataclasses.replace(cfg, cluster=cluster), run_dir),
        held=[(resume.checkpoint_dir(cfg, run_dir), "checkpoint.dir")], total_steps=cfg.optim.max_steps).run()
    return None if submitted.results is None else report(submitted.results[0], run_dir)


# -- a hyperparameter search's trials (orchestrator/search finds these two by the module's name) ------


def compose_trial(overrides: Sequence[str]) -> TrainConfig:
    """A trial's typed config: this app's config with ``overrides``, composed by Hydra (in the
    running ``-m`` app, or in ``switchyard search resume``'s process) and checked as a run's."""
    from hydra.core.global_hydra import GlobalHydra

    fresh = not GlobalHydra.instance().is_initialized()
    if fresh:
        hydra.initialize_config_module(config_module="conf", version_base="1.3")
    try:
        cfg = hydra.compose(config_name="train", overrides=list(overrides))
    except Exception as e:  # Hydra's and OmegaConf's errors: an unknown key, a bad value
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "not in struct" in line), "")
        raise ConfigError(f"{lines[0] if lines else type(e).__name__}{f' ({why})' if why else ''}") from e
    finally:
        if fresh:
            GlobalHydra.instance().clear()
    return load_config(cfg)


def search_check(overrides: Sequence[str]) -> Any:
    """A trial's config checked before the search submits anything: what the controller needs of it."""
    from orchestrator.search.controller import TrialShape

    cfg = compose_trial(overrides)
    if cfg.cluster.mode not in ("local", "slurm") or cfg.cluster.dry_run:
        raise ConfigError(f"cluster.mode={cfg.cluster.mode!r} cannot run a search's trials: each trial "
                          f"is a job "
                          f"of its own (try cluster=local or cluster=slurm, without cluster.dry_run)")
    check_before_submit(cfg)  # the data and each rank's memory, as a run's submission checks them
    return TrialShape(cfg.cluster.mode, cfg.eval_every_steps, cfg.optim.max_steps)


def search_submit(overrides: Sequence[str], run_dir: Path, into: single.Into) -> None:
    """One trial: an ordinary ``jobs.train`` job in its own run directory, recorded as the search's
    job ``into.num``, not followed (the controller polls the registry, as cluster.wait=false)."""
    cfg = compose_trial(overrides)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, wait=False))
    Submission(
        app="train", command=" ".join(overrides), run_dir=run_dir, cluster=cfg.cluster,
        parallelism=cfg.parallelism, overrides=overrides,
        check=lambda cluster: plan(dataclasses.replace(cfg, cluster=cluster), run_dir),
        held=[(resume.checkpoint_dir(cfg, run_dir), "checkpoint.dir")], announce=False, follow=False,
        into=into).run()


def plan(cfg: TrainConfig, run_dir: Path) -> Plan[dict[str, Any]]:
    """What a submitted training job runs, once everything that can be checked here is."""
    paths, memory = check_before_submit(cfg, run_dir)

    def before_submit() -> None:
        if memory is not None:
            print(memory.line(), flush=True)
            estimate.write_report(run_dir, memory)  # rank 0 puts it in summary.json beside the peak

    return Plan(train_job, (cfg, paths, str(run_dir)), OmegaConf.to_yaml(cfg), targets=snapshot.targets(cfg),
                mounts=container_paths(cfg, paths, run_dir), rank_modules=rank_process.rank_modules(cfg),
                own_code=True, dry_run_preface=memory.table() if memory is not None else None,
                before_submit=before_submit)


def train_job(cfg: TrainConfig, paths: trainer.DataPaths, run_dir: str) -> dict[str, Any]:
    """What each rank of a submitted job runs: its training, rank 0 reporting the attempt for
    ``switchyard status`` (node, start, end)."""
    env = dist_env.detect()
    return single.run_reporting(run_dir, env.job_id, env.restart_count, env.hostname, env.is_main,
                                lambda: rank_process.train_rank(cfg, paths, run_dir))


def run_attached(cfg: TrainConfig, run_dir: Path, launch: dist_env.DistEnv, overrides: Sequence[str]
                 ) -> dict[str, Any]:
    """One rank of the user's own srun or torchrun (``orchestrator.launch.attach``): rank 0 checks
    what the submitting side checks elsewhere, then every rank trains here."""
    launcher, explicit = attach.describe(launch), attach.explicit_keys(overrides)
    if launch.is_main:
        print(f"run_dir: {run_dir}\nattached to {launcher}: {launch.world_size} ranks on "
              f"{launch.num_nodes} node(s); cluster.mode={cfg.cluster.mode!r} is not used", flush=True)
        with rank_process.before_rendezvous(launch, run_dir):
            ownership.claim(run_dir, ownership.Claimant.of("train", overrides))
            cfg = dataclasses.replace(cfg, parallelism=attach.fit_to_launch(
                cfg.parallelism, launch, explicit, launcher, torch.cuda.device_count()))
            paths, memory = check_before_submit(cfg, run_dir)
            if memory is not None:
                print(memory.line(), flush=True)
                estimate.write_report(run_dir, memory)
        return report(train_attached(cfg, paths, run_dir, launch), run_dir, notes=False)
    # Rank 0 reports what fails before the rendezvous: one copy of the error, not one per rank.
    try:
        cfg = dataclasses.replace(cfg, parallelism=attach.fit_to_launch(
            cfg.parallelism, launch, explicit, launcher, torch.cuda.device_count()))
    except ConfigError:
        sys.exit(2)
    paths = data_paths(cfg)  # rank 0 generates the demo data before it serves the rendezvous
    try:
        return train_attached(cfg, paths, run_dir, launch)
    except rendezvous.RankZeroFailedError:
        sys.exit(2)


# Refusals every rank reaches alike (a resume the checkpoint cannot follow, a bad value): one line
# from rank 0, as cluster=slurm reports them, instead of a traceback from each rank.
SAME_ON_EVERY_RANK = (ConfigError, CheckpointError)


def train_attached(cfg: TrainConfig, paths: trainer.DataPaths, run_dir: Path, launch: dist_env.DistEnv
                   ) -> dict[str, Any]:
    """``rank_process.train_rank`` as one rank of the user's own launch, its failures told as
    ``cluster=slurm`` tells them: a refusal once, in one line; a collective timeout by the
    heartbeats' verdict, naming the rank the others waited for (``attach.hang_report``). Either
    exits 2; any other error is the rank's own and keeps its traceback (exit 1).

    A failed rank leaves with ``exit_now``, not the interpreter's shutdown: after a collective
    timed out, freeing DDP's reducer at shutdown joins gloo's worker threads while holding the GIL,
    and a worker finishing the timed-out work waits for the GIL to free its tensors, so the rank
    never exited and the user's torchrun waited for it forever (seen once in CI, rank 0 of
    test_a_frozen_rank_under_torchrun_is_named)."""
    try:
        return rank_process.train_rank(cfg, paths, str(run_dir))
    except SAME_ON_EVERY_RANK as e:
        if launch.is_main:
            print(f"error: {printable(e)}", file=sys.stderr, flush=True)
        exit_now(2)
    except Exception as e:
        told = attach.hang_report(e, run_dir, launch)
        if told is None:
            traceback.print_exc()
            exit_now(1)
        if told:
            print(f"error: {printable(told)}", file=sys.stderr, flush=True)
        exit_now(2)


def report(summary: dict[str, Any], run_dir: Path, notes: bool = True) -> dict[str, Any]:
    """What the submitting side prints at the end; an attached rank 0 (``notes=False``) printed
    the checkpoint notes itself when it resumed."""
    for warning in summary.get("checkpoint_warnings") or [] if notes else []:  # also in summary.json
        print(f"warning: {warning}", file=sys.stderr)
    skipped = summary.get("skipped_nonfinite_steps") or []
    if skipped:  # also in summary.json; each rank's log has a line per step
        print(f"warning: {len(skipped)} step(s) had a NaN or infinite loss or gradient and were "
              f"skipped (optim.on_nonfinite=skip): steps {skipped[:10]}", file=sys.stderr)
    for slow in summary.get("stragglers") or []:  # also in summary.json and RUN/stragglers.json
        print(f"warning: {Straggler(**slow).line().removeprefix('switchyard: ')}", file=sys.stderr)
    if notes and summary.get("resumed_from"):  # with the config changes it applied
        print("\n".join(provenance.resume_lines(summary["resumed_from"])))
    if (calibrated := estimate.calibration(summary)) is not None:  # every GPU run checks the estimate
        print(calibrated)
    print(f"summary: {run_dir / 'summary.json'}")
    print(json.dumps({k: summary[k] for k in ("world_size", "steps", "samples_per_rank",
                                              "final_train_loss", "final_eval_loss",
                                              "eval_samples_counted", "wall_s")}))
    return cast(dict[str, Any], summary)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="train")
@hydra_task
def main(cfg: DictConfig) -> None:
    try:
        hydra_cfg = HydraConfig.get()
        run(load_config(cfg), Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    except submit.JobStoppedError as e:  # a cancel (or preemption) is not a failure: say where it stopped
        print(f"stopped: {printable(e)}", file=sys.stderr)
        sys.exit(submit.STOPPED_EXIT_CODE)
    except ConfigError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except submit.JobFailedError as e:  # the failing rank's log tail: several lines
        print(f"error: {printable(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if dist_env.attached_launch() is None and not dist_env.inside_launched_job():
        fork_start.fork_template()  # imported, nothing else done: a local job's controller to be
    sys.argv = [sys.argv[0], *any_model_compile(sys.argv[1:])]  # model.compile=true for any model
    hydra_app(main, sys.argv)
    exit_now()  # done and printed: skip torch's second of interpreter finalisation
