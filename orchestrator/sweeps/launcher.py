"""Hydra sweeps as SLURM job arrays (or local processes): the logic behind Switchyard's launcher
(``hydra_plugins/switchyard_launcher`` plugs :func:`launch` into Hydra).

Submit side, :func:`launch`, in this order so that bad input queues nothing:

1. compose, resolve and check every point (``points``): the app's typed config, the launcher's
   resources; errors name the point.
2. check that each partition exists and the sweep fits SLURM's limits (``arrays``): more jobs than
   ``MaxJobCount`` leaves room for is refused here.
3. snapshot the code and write each point's files (``points``).
4. record the sweep and its jobs in the registry, then submit one
   ``sbatch --array=0-N%array_parallelism`` per group of equal resources (``arrays``).
5. wait and return Hydra's ``JobReturn`` list (blocking), or print the sweep id and return.

Node side: ``node.run_point``, what every task of a point's job runs.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from orchestrator.config import ConfigError
from orchestrator.entry import task_started
from orchestrator.launch import dist_env, local_jobs, ownership, provenance, slurm_query
from orchestrator.registry.db import Job, Registry, RegistryError, damage_reported
from orchestrator.registry.reconciliation import reconcile
from orchestrator.sweeps.arrays import (
    SUBMITIT_FOLDER,
    Launched,
    LauncherSettings,
    SweepError,
    array_chunks,
    check_cluster_limits,
    check_local_window,
    check_partitions,
    check_sweep_dir,
    group_points,
    max_array_size,
    run_local_window,
    submit_all,
)
from orchestrator.sweeps.node import result_path
from orchestrator.sweeps.points import (
    Point,
    add_containers,
    install_composition_cache,
    prepare_point,
    take_snapshots,
    user_packages,
    write_entry,
    write_point,
)
from orchestrator.sweeps.results import keep_ended_results

if TYPE_CHECKING:
    from hydra.core.utils import JobReturn
    from hydra.types import HydraContext

__all__ = ["LauncherSettings", "SweepError", "SweepState", "install_composition_cache", "launch"]

log = logging.getLogger(__name__)

LOCAL_CONTROLLER_LOG = ".submitit/local-controllers.log"  # what submitit's local controllers print


@dataclass
class SweepState:
    """Kept by the launcher across Hydra's batches of one sweep (max_batch_size)."""

    sweep_id: int | None = None
    entry: Path | None = None



def launched_by_another_task() -> str | None:
    """Why this process must not submit the sweep, or None. A ``-m`` sweep started in every task
    of a multi-task ``srun`` (or by every torchrun worker) was submitted once per task: two sweeps
    of the same points, whose second copies then failed on the run lock. Task 0 submits it."""
    attached = dist_env.attached_launch()
    if attached is None or attached.is_main:
        return None
    return (f"Switchyard: task {attached.rank} of {attached.world_size} of {dist_env.launch_name()}: "
            f"the sweep is submitted by task 0 only, so it goes out once; this task exits 0 "
            f"(start a sweep from one task: srun -n1, or outside srun)")


def check_registry(path: str | None) -> None:
    """The registry opens: one written by a newer Switchyard, damaged or with its version stamp
    reset is refused while the sweep is still being checked, so a Switchyard app says it in one
    ``error:`` line with exit 2 as a single job does (it was Hydra's two lines, its
    HYDRA_FULL_ERROR hint and exit 1), before any snapshot is taken or anything is submitted."""
    try:
        with Registry(path):
            pass
    except RegistryError as e:
        raise SweepError(str(e)) from e


def launch(settings: LauncherSettings, hydra_context: HydraContext, task_function: Callable[..., Any],
           master: DictConfig, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
           state: SweepState) -> list[JobReturn]:
    """Hydra's ``Launcher.launch``: compose and check everything, record, submit, wait or return."""
    from hydra.core.utils import configure_log, setup_globals

    if (elsewhere := launched_by_another_task()) is not None:
        print(elsewhere, flush=True)
        sys.exit(0)  # not an error: the sweep goes out once, from task 0
    setup_globals()
    configure_log(master.hydra.hydra_logging, master.hydra.verbose)
    # `from None` below: Hydra's one line would repeat a chained cause's message
    try:
        ownership.check_path(str(master.hydra.sweep.dir), "hydra.sweep.dir")
    except ConfigError as e:
        raise SweepError(str(e)) from None
    sweep_dir = Path(str(master.hydra.sweep.dir)).absolute()
    if settings.executor == "slurm":
        check_sweep_dir(sweep_dir)
    this = ownership.Claimant.of(str(master.hydra.job.name), [sweep_command(master)])
    dirs = ownership.SweepDirs(this)  # each point its own run directory, none the user's or a live run's
    points = [prepare_point(settings, hydra_context, master, list(overrides), initial_job_idx + i,
                            sweep_dir, dirs) for i, overrides in enumerate(job_overrides)]
    if settings.executor == "slurm":
        check_partitions(points)
        check_cluster_limits(len(points))
    _warn_ignored_resources(settings, points)
    wait = settings.wait if settings.wait is not None else _app_wait(points)
    if settings.executor == "local" and not wait:
        check_local_window(len(points), settings.array_parallelism)
    check_registry(settings.registry)
    # checked: what fails from here on is not the user's input, and the jobs started below must
    # not inherit orchestrator.entry.hydra_app's HYDRA_FULL_ERROR
    task_started()
    take_snapshots(points)
    add_containers(points, sweep_dir)
    origin = provenance.origin(packages=user_packages(points, task_function))
    diff = provenance.write_diff(sweep_dir, origin)  # once per submission, named by every point
    try:
        with Registry(settings.registry) as registry, damage_reported(registry.path):
            if state.sweep_id is None:  # Hydra's later batches of the same sweep join it
                state.entry = write_entry(sweep_dir, task_function, hydra_context)
                state.sweep_id = registry.create_sweep(
                    app=str(master.hydra.job.name), command=sweep_command(master),
                    sweep_dir=str(sweep_dir), executor=settings.executor, entry_path=str(state.entry))
            entry = cast(Path, state.entry)
            registry.record_provenance(state.sweep_id,
                                       {p.num: write_point(p, entry, origin, diff) for p in points})
            for p in points:  # the registry says from now on whether the point's run is live
                ownership.record_job(p.run_dir, registry.path, state.sweep_id, p.num, None, this)
            registry.add_jobs(Job(state.sweep_id, p.num, p.overrides, str(p.run_dir), asdict(p.resources),
                                  p.total_steps) for p in points)
            return _submit_and_wait(settings, registry, state.sweep_id, points, sweep_dir, wait)
    except RegistryError as e:  # unreadable or damaged: Hydra prints a SweepError as one line
        raise SweepError(str(e)) from e


def _submit_and_wait(settings: LauncherSettings, registry: Registry, sweep_id: int,
                     points: Sequence[Point], sweep_dir: Path, wait: bool) -> list[JobReturn]:
    groups, folder = group_points(points), sweep_dir / SUBMITIT_FOLDER
    num_arrays = sum(len(array_chunks(len(g), max_array_size(g[0].resources))) for g in groups)
    log.info(f"Switchyard: sweep {sweep_id}: {len(points)} jobs in {num_arrays} "
             f"{'array' if settings.executor == 'slurm' else 'group'}(s) -> {sweep_dir}")
    for p in points:
        log.info(f"\t#{p.num} : {' '.join(p.overrides)}")
    where = f" --registry {settings.registry}" if settings.registry else ""
    try:
        if settings.executor == "local" and wait:
            launched = run_local_window(registry, sweep_id, groups, folder, settings.poll_s)
        elif settings.executor == "local":  # not waiting: the controllers must not hold our pipes
            with local_jobs.detached_output(sweep_dir / LOCAL_CONTROLLER_LOG):
                launched = submit_all(registry, sweep_id, groups, folder)
        else:
            launched = submit_all(registry, sweep_id, groups, folder)
        if not wait:
            _print_submitted(sweep_id, launched, settings.registry)
            return [submitted_return(item, sweep_id) for item in launched]
        returns = [outcome(item) for item in launched]
    except KeyboardInterrupt:
        print(f"\nsweep {sweep_id}: what was submitted keeps running. Follow it with switchyard status "
              f"{sweep_id}{where}; stop it with switchyard cancel {sweep_id}{where}", file=sys.stderr)
        raise
    _settle(registry, sweep_id)
    states = Counter(a.state.lower() for a in registry.latest_attempts(sweep_id).values())
    log.info(f"Switchyard: sweep {sweep_id} ended: {', '.join(f'{n} {s}' for s, n in states.items())} "
             f"(switchyard status {sweep_id}{where})")
    return returns


def sweep_command(master: DictConfig) -> str:
    """The sweep's overrides as typed, and for ``switchyard run -m`` the command after ``--``
    (unresolved: ``${lr}`` as the user wrote it)."""
    overrides = " ".join(master.hydra.overrides.task)
    command = master.get("command") if "command" in master else None
    if not isinstance(command, ListConfig):
        return overrides
    argv = OmegaConf.to_container(command, resolve=False)
    return f"{overrides} -- {shlex.join(str(a) for a in cast(list[Any], argv))}"


RESOURCE_FIELDS = ("partition", "account", "qos", "constraint", "exclude", "timeout_min", "mem_gb",
                   "cpus_per_task", "nodes", "tasks_per_node", "gpus_per_node", "signal_delay_s",
                   "max_requeues", "setup", "srun_args")


def _warn_ignored_resources(settings: LauncherSettings, points: Sequence[Point]) -> None:
    """jobs.train's resources come from its groups; a hydra.launcher one set too would be a no-op."""
    defaults = LauncherSettings()
    changed = [f for f in RESOURCE_FIELDS if getattr(settings, f) != getattr(defaults, f)]
    if changed and any(p.is_ddp for p in points):
        log.warning(f"hydra.launcher.{{{','.join(changed)}}} ignored: these jobs take their resources "
                    f"from their cluster and parallelism groups (set cluster.* or parallelism.*)")


def _app_wait(points: Sequence[Point]) -> bool:
    """jobs.train's cluster.wait decides when the launcher is not told (cluster.wait=false)."""
    waits = {OmegaConf.select(p.config, "cluster.wait", default=None) for p in points} - {None}
    return all(waits) if waits else True



def _print_submitted(sweep_id: int, launched: Sequence[Launched[Point]], registry_path: str | None) -> None:
    arrays = sorted({str(item.job.job_id).split("_")[0] for item in launched})
    where = f" --registry {registry_path}" if registry_path else ""
    print(f"sweep_id: {sweep_id}\n{len(launched)} jobs submitted in {len(arrays)} "
          f"submission(s): {', '.join(arrays)}\nfollow it with: switchyard status {sweep_id}{where}",
          flush=True)


def _job_return(point: Point, status: Any, value: Any) -> JobReturn:
    from hydra.core.utils import JobReturn

    # hydra_cfg stays None: nothing reads it from a launcher's returns, and copying the hydra node
    # costs tens of ms per point, which a 1000-point non-blocking sweep would wait for.
    ret = JobReturn(overrides=point.overrides, cfg=point.task_cfg, hydra_cfg=None,
                    working_dir=str(point.run_dir),
                    task_name=str(point.config.hydra.job.name), status=status)
    ret.return_value = value
    return ret


def submitted_return(item: Launched[Point], sweep_id: int) -> JobReturn:
    """Non-blocking: the job is queued, which is all this process will know."""
    from hydra.core.utils import JobStatus

    return _job_return(item.point, JobStatus.COMPLETED,
                       {"sweep_id": sweep_id, "job": f"{sweep_id}/{item.point.num}",
                        "slurm_id": str(item.job.job_id)})


def outcome(item: Launched[Point]) -> JobReturn:
    """Blocking: rank 0's JobReturn; for a failure, the task's own exception when rank 0 failed
    first and got to report one, else a JobFailedError naming the rank that failed first, its node
    and log tail (as a single job's report does)."""
    import cloudpickle
    from hydra.core.utils import JobStatus

    from orchestrator.launch import submit

    try:
        return cast("JobReturn", submit.results(item.job, item.point.run_dir)[0])
    except submit.JobFailedError as e:
        saved = result_path(item.point.run_dir, str(item.job.job_id))
        # Rank 0's own JobReturn only when rank 0 failed first: after another rank's failure it
        # holds the consequence ("Connection closed by peer"), while the report names the cause.
        if e.failed_ranks[:1] == [0] and saved.exists():
            try:
                return cast("JobReturn", cloudpickle.loads(saved.read_bytes()))
            except Exception:  # the exception's class cannot be rebuilt here: report the logs
                pass
        return _job_return(item.point, JobStatus.FAILED, e)


def _settle(registry: Registry, sweep_id: int, timeout_s: float = 30.0) -> None:
    """After a blocking wait: give sacct a moment to record the ends, so the registry is final,
    then keep what each ended job left in it, so the first ``status`` after reads no job files."""
    deadline = time.monotonic() + timeout_s
    while True:
        reconciled = reconcile(registry, [sweep_id], ask_slurm=slurm_query.query_states)
        if not registry.unsettled([sweep_id]) or time.monotonic() > deadline:
            for warning in reconciled.warnings:
                log.warning(f"Switchyard: {warning}")
            keep_ended_results(registry, sweep_id)
            return
        time.sleep(0.5)
