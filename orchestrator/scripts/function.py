"""A Python function as every rank of a job: what ``switchyard.submit`` does.

As submitit's ``executor.submit(fn, *args)``, with Switchyard around it: the ``cluster`` and
``parallelism`` groups (``conf/run.yaml``, composed with the caller's overrides), the checks before
submission, a run directory, a registry entry, memory telemetry, and on every rank the variables a
torchrun-style function expects (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...),
so ``dist.init_process_group("gloo")`` just works. The rank's Switchyard process serves the store
on rank 0, as for ``switchyard run``.

Requeue is submitit's own: a function or callable object with a ``checkpoint()`` method keeps it
(``submit.CheckpointableRankEntry`` and :class:`CheckpointableFunctionRank` pass it through), and
on SLURM's time-limit signal rank 0 calls it and requeues, as plain submitit would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import submitit
from omegaconf import OmegaConf

from durable import atomic
from orchestrator.config import ConfigError
from orchestrator.launch import (
    dist_env,
    local_jobs,
    rank_env,
    run_lock,
    single,
    slurm_query,
)
from orchestrator.launch.cancel import cancel as cancel_recorded
from orchestrator.launch.submission import Plan, Submission
from orchestrator.registry.db import SINGLE_NUM, Registry
from orchestrator.registry.reconciliation import reconcile
from orchestrator.scripts import job as run_job
from orchestrator.scripts import rank
from orchestrator.scripts.schema import RunConfig, register_run_configs
from orchestrator.telemetry.files import register_rank
from orchestrator.telemetry.preflight import preflight
from orchestrator.telemetry.sampler import MemorySampler

APP = "submit"
CANCEL_GRACE_S = 5.0  # Job.cancel(): SIGTERM to SIGKILL for a local job's ranks


@dataclass(frozen=True)
class FunctionSpec:
    run_dir: str
    gpus_per_node: int
    max_requeues: int
    rendezvous_timeout_s: float
    telemetry: bool
    telemetry_interval_s: float


@dataclass(frozen=True)
class FunctionRank:
    """What each rank runs: the store, the variables, telemetry, then the user's function."""

    fn: Callable[..., Any]
    spec: FunctionSpec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        env, run = dist_env.detect(), Path(self.spec.run_dir)
        with contextlib.ExitStack() as held:
            if env.is_main:
                held.enter_context(run_lock.hold(run, f"job {env.job_id} (rank 0, pid {os.getpid()} "
                                                      f"on {env.hostname})"))
            with rank_of_function(self.spec, run, env):
                return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class CheckpointableFunctionRank(FunctionRank):
    """A FunctionRank whose function has submitit's ``checkpoint()``: passed through, and what it
    returns wrapped again, so the requeued job runs as a FunctionRank too."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        resumed = getattr(self.fn, "checkpoint")(*args, **kwargs)  # noqa: B009 (Callable has none)
        if resumed is not None:
            resumed.function = function_rank(resumed.function, self.spec)
        return resumed


def function_rank(fn: Callable[..., Any], spec: FunctionSpec) -> FunctionRank:
    if isinstance(fn, FunctionRank):
        return fn
    kind = CheckpointableFunctionRank if callable(getattr(fn, "checkpoint", None)) else FunctionRank
    return kind(fn, spec)


@contextlib.contextmanager
def rank_of_function(spec: FunctionSpec, run: Path, env: dist_env.DistEnv) -> Iterator[None]:
    """Around the function on one rank: preflight, the store (rank 0), the process group's
    variables (restored after: debug mode runs in the caller's process), telemetry and the status."""
    report = preflight(spec.gpus_per_node, env.local_rank, env.local_world_size)
    print(report.describe(), flush=True)
    rdzv = run / "rendezvous"
    store, endpoint = rank_env.serve_or_find_store(env, rdzv, spec.rendezvous_timeout_s)
    variables = rank_env.rank_variables(env, endpoint, run, spec.max_requeues)
    status = rank.report_start(run, env)
    register_rank(run, env.rank, env.local_rank, env.hostname, report.device_index)
    sampler = MemorySampler(run, env.hostname, spec.telemetry_interval_s, attempt=env.restart_count) \
        if spec.telemetry and env.is_local_main else None
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    code, ended = 1, True
    try:
        with sampler or contextlib.nullcontext():
            yield
        code = 0
    except SystemExit:  # submitit's requeue after checkpoint() (or the function's own exit)
        ended = False  # the attempt goes on: a requeued life reports its own start and end
        raise
    finally:
        _restore(saved)
        rank.mark_done(rdzv, env, code, time.time(), stopped=not ended)
        error = None if code == 0 else "the function raised"
        if env.is_main and code == 0:  # the store stays up until every rank's function returned
            peer = rank.first_failed(rank.wait_for_ranks(rdzv, env))
            if peer is not None:  # the job's end is every rank's, not rank 0's alone
                code, error = 1, (f"rank {peer.rank}{f' on node {peer.node}' if peer.node else ''} "
                                  f"failed after rank {env.rank}'s function had returned")
        if ended:
            rank.report_end(run, status, code, error, telemetry=spec.telemetry and code != 0)
        del store


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# ------------------------------------------------------------------------------------------------
# The submitting side


class FunctionJob:
    """A submitted function: ``result()`` (every rank's return value), ``status``, ``cancel()``."""

    def __init__(self, job: submitit.Job[Any], run_dir: Path, recorded: single.Recorded | None) -> None:
        self.job = job
        self.run_dir = run_dir
        self.recorded = recorded
        self._results: list[Any] | None = None

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def ref(self) -> str | None:
        """Its name in ``switchyard status``: SWEEP/0."""
        return self.recorded.ref if self.recorded else None

    def result(self) -> list[Any]:
        """Every rank's return value, in rank order; ``submit.JobFailedError`` names the rank
        that failed, its node and its log tail."""
        if self._results is None:
            self._results = single.results(self.recorded, self.job, self.run_dir)
        return self._results

    @property
    def status(self) -> str:
        """The registry's state (SLURM's names: PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        if self.recorded is None or isinstance(self.job, submitit.DebugJob):
            return str(self.job.state)
        with Registry(self.recorded.registry) as registry:
            reconcile(registry, [self.recorded.sweep_id], ask_slurm=slurm_query.query_states)
            attempt = registry.latest_attempts(self.recorded.sweep_id)[SINGLE_NUM]
        return attempt.state

    def cancel(self) -> None:
        """scancel (SLURM), or SIGTERM then SIGKILL to every rank (local), as ``switchyard
        cancel`` does and with its check: a job that has ended (its ``result()`` returned, or it
        failed) is left as it is, never turned CANCELLED."""
        if isinstance(self.job, submitit.DebugJob):
            return
        if self.recorded is not None:
            with Registry(self.recorded.registry) as registry:
                cancel_recorded(registry, self.recorded.sweep_id, SINGLE_NUM, CANCEL_GRACE_S, "Job.cancel()")
        elif not self.job.done():  # not in the registry: submitit's own view of its end
            if isinstance(self.job, submitit.SlurmJob):
                self.job.cancel(check=False)
            else:
                local_jobs.terminate([int(self.job.job_id)], grace_s=CANCEL_GRACE_S)

    def __repr__(self) -> str:
        return f"FunctionJob({self.ref or self.job_id}, run_dir={str(self.run_dir)!r})"


def compose(overrides: Sequence[str]) -> RunConfig:
    """``conf/run.yaml`` with the overrides, typed and checked, as ``switchyard run`` composes it.
    Works beside an application that uses Hydra itself: its global state is put back after."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_run_configs()
    global_hydra = GlobalHydra.instance()
    saved = global_hydra.hydra
    global_hydra.clear()
    try:
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = hydra_compose(config_name="run", overrides=list(overrides))
    finally:
        global_hydra.hydra = saved
    return run_job.load_config(cfg)


def default_run_dir(fn: Callable[..., Any]) -> Path:
    name = getattr(fn, "__name__", type(fn).__name__)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")  # with the pid: one per submission
    return Path("outputs/submit") / f"{stamp}-{os.getpid()}-{name}"


def submit_function(fn: Callable[..., Any], *args: Any, overrides: Sequence[str] = (),
                    run_dir: str | Path | None = None, **kwargs: Any) -> FunctionJob:
    """Run ``fn(*args, **kwargs)`` on every rank of a job; ``overrides`` as on the command line
    (``["cluster=slurm", "parallelism.nodes=2"]``). Returns once it is queued (debug: runs at
    ``result()``)."""
    cfg = compose(overrides)
    run = Path(run_dir or default_run_dir(fn)).absolute()
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    submitted = Submission(
        app=APP, command=f"{name} {' '.join(overrides)}".strip(), run_dir=run, cluster=cfg.cluster,
        parallelism=cfg.parallelism, overrides=overrides, announce=False, follow=False, key="run_dir",
        claimed_as=[name, *overrides],
        dir_checked=False,
        check=lambda cluster: plan(fn, dataclasses.replace(cfg, cluster=cluster), run, args, kwargs)).run()
    return FunctionJob(cast(submitit.Job[Any], submitted.job), run, submitted.recorded)


def plan(fn: Callable[..., Any], cfg: RunConfig, run: Path, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> Plan[Any]:
    """Every rank runs ``fn`` behind ``FunctionRank``; its module is the snapshot's to hold."""
    if cfg.cluster.dry_run:
        raise ConfigError("cluster.dry_run=true is not for switchyard.submit, which returns the queued job "
                          "(try `switchyard run --dry-run ... -- python your_script.py` to see the script)")
    run_job.check_resources(cfg)
    spec = FunctionSpec(str(run), cfg.parallelism.gpus_per_node, cfg.cluster.max_requeues,
                        cfg.cluster.rendezvous_timeout_s, cfg.telemetry.enabled, cfg.telemetry.interval_s)
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    module = getattr(fn, "__module__", None) or "__main__"  # __main__ is pickled by value
    return Plan(function_rank(fn, spec), args, config_yaml, kwargs=kwargs,
                targets=[] if module == "__main__" else [module],
                before_submit=lambda: atomic.write_text(run / "config.yaml", config_yaml))
