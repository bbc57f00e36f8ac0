"""Hydra sweeps as SLURM job arrays (or local processes): the logic behind Switchyard's launcher.

Submit side, :func:`launch`, in this order so that bad input queues nothing:

1. compose every point here, once, with Hydra's own loader; give it its job number and run
   directory, and resolve every interpolation. The resolved config is written into the point's run
   directory (``RUN/.switchyard/config.pkl``, what the job loads; ``config.yaml`` beside it for
   people). Nothing is composed on the node, so editing YAML while the sweep waits in the queue
   changes nothing.
2. check every point: the app's typed config (``jobs.train``: schema checks, dataset, model), the
   launcher's resources, and that each partition exists; errors name the point.
3. check the sweep against SLURM's limits (``scontrol show config``): more jobs than
   ``MaxJobCount`` leaves room for is refused here.
4. record the sweep and its jobs in the registry, then group the points by resource request and
   submit one ``sbatch --array=0-N%array_parallelism`` per group, or several where a group has
   more points than ``MaxArraySize``.
5. wait and return Hydra's ``JobReturn`` list (blocking), or print the sweep id and return.

Node side, :func:`run_point`: every task of a point's job loads the saved config and runs Hydra's
``run_job`` with the task function. Points whose config has Switchyard's ``cluster`` and
``parallelism`` groups get ``nodes x tasks_per_node`` tasks and ``SWITCHYARD_IN_JOB=1``, so each
task is one DDP rank; any other Hydra app gets the launcher's own resources (one task by default).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.errors import CompactHydraException, HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from orchestrator import atomic
from orchestrator.config import ClusterConfig, ConfigError, ParallelismConfig, SnapshotConfig, app_check
from orchestrator.launch import dist_env, local_jobs, provenance, slurm_query, snapshot
from orchestrator.sweeps.registry import (
    RETRY_STATES,
    Job,
    Registry,
    RegistryError,
    Submitted,
    TaskStatus,
    damage_reported,
    reconcile,
)

if TYPE_CHECKING:
    import submitit
    from hydra.core.config_loader import ConfigLoader
    from hydra.core.utils import JobReturn
    from hydra.types import HydraContext

log = logging.getLogger(__name__)

EXECUTORS = ("slurm", "local")
POINT_DIR = ".switchyard"  # inside each point's run directory
SWEEP_ENTRY = ".switchyard/entry.pkl"  # inside the sweep directory
SUBMITIT_FOLDER = ".submitit/%j"  # inside the sweep directory; one folder per array task
LOCAL_CONTROLLER_LOG = ".submitit/local-controllers.log"  # what submitit's local controllers print


class SweepError(CompactHydraException, ValueError):
    """Bad input found before anything was queued; the message names the point and a fix.

    A CompactHydraException: Hydra prints the message alone, as for its own composition errors.
    """


class PointFailed(RuntimeError):
    """A point's task function raised (its exception is chained); the job ends FAILED in SLURM."""


@dataclass
class LauncherSettings:
    """``hydra.launcher.*`` of the ``switchyard_slurm`` and ``switchyard_local`` launchers."""

    executor: str = "slurm"  # slurm: one sbatch array per resource group | local: processes here
    wait: bool | None = None  # block until every job ends; null: the app's cluster.wait, else true
    array_parallelism: int = 256  # at most this many tasks of one array run at once (--array=..%N)
    registry: str | None = None  # SQLite file; null: $SWITCHYARD_REGISTRY or ~/.local/share/switchyard
    poll_s: float = 1.0  # blocking mode: seconds between looks at the jobs
    # Resources for apps without Switchyard's cluster/parallelism groups (jobs.train takes its own):
    job_name: str = "switchyard"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    timeout_min: int = 60
    mem_gb: float | None = None  # per node; null: the partition's default
    cpus_per_task: int = 1
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    signal_delay_s: int = 30  # SIGUSR2 this long before the time limit
    max_requeues: int = 0  # submitit requeues on timeout/preemption (checkpointable functions only)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun
    srun_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise SweepError(f"hydra.launcher.executor={self.executor!r} is invalid: choose one of "
                             f"{EXECUTORS} (try hydra/launcher=switchyard_slurm)")
        if self.array_parallelism < 1:
            raise SweepError(f"hydra.launcher.array_parallelism={self.array_parallelism} is invalid: "
                             f"must be >= 1 (try hydra.launcher.array_parallelism=32)")
        if self.poll_s <= 0:
            raise SweepError(f"hydra.launcher.poll_s={self.poll_s} is invalid: must be > 0 "
                             f"(try hydra.launcher.poll_s=1)")

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> LauncherSettings:
        """From Hydra's instantiation kwargs (lists arrive as ListConfig)."""
        plain: dict[str, Any] = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
                                 for k, v in params.items() if not k.startswith("_")}
        return cls(**plain)


# ------------------------------------------------------------------------------------------------
# Resources: what a point asks of the executor; equal resources share one array


@dataclass(frozen=True)
class Resources:
    executor: str  # slurm | local
    params: dict[str, Any]  # submitit executor parameters
    max_requeues: int
    array_parallelism: int
    source: str  # where the user sets them: "cluster" (the app's group) or "hydra.launcher"

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Resources:
        return cls(**data)


def resources_for(settings: LauncherSettings, groups: tuple[ClusterConfig, ParallelismConfig] | None
                  ) -> Resources:
    from orchestrator.launch.submit import local_parameters, slurm_parameters  # imports submitit

    cluster, parallelism = groups or _launcher_groups(settings)
    params = local_parameters(cluster, parallelism) if settings.executor == "local" \
        else slurm_parameters(cluster, parallelism)
    return Resources(settings.executor, params, cluster.max_requeues, settings.array_parallelism,
                     "cluster" if groups else "hydra.launcher")


def _launcher_groups(settings: LauncherSettings) -> tuple[ClusterConfig, ParallelismConfig]:
    """The launcher's resource fields, through the same schema (and checks) as jobs.train's."""
    try:
        cluster = ClusterConfig(mode=settings.executor, job_name=settings.job_name,
                                partition=settings.partition, account=settings.account,
                                qos=settings.qos, constraint=settings.constraint,
                                exclude=settings.exclude, timeout_min=settings.timeout_min,
                                mem_gb=settings.mem_gb, cpus_per_task=settings.cpus_per_task,
                                signal_delay_s=settings.signal_delay_s,
                                max_requeues=settings.max_requeues, setup=list(settings.setup),
                                srun_args=list(settings.srun_args))
        parallelism = ParallelismConfig(nodes=settings.nodes, gpus_per_node=settings.gpus_per_node,
                                        procs_per_node=settings.tasks_per_node)
    except ConfigError as e:
        message = str(e).replace("cluster.", "hydra.launcher.").replace(
            "parallelism.procs_per_node", "hydra.launcher.tasks_per_node").replace(
            "parallelism.", "hydra.launcher.")
        raise SweepError(message) from e
    return cluster, parallelism


# ------------------------------------------------------------------------------------------------
# Points: composed, resolved and checked before anything is queued


@dataclass
class Point:
    num: int  # hydra.job.num
    overrides: list[str]
    config: DictConfig  # the whole resolved config, hydra node included: what the job runs
    task_cfg: DictConfig  # the same without the hydra node: what the task function sees
    run_dir: Path
    resources: Resources
    is_ddp: bool  # has cluster/parallelism groups: every task is a rank, SWITCHYARD_IN_JOB=1
    total_steps: int | None  # optim.max_steps, for progress
    code: snapshot.Snapshot | None = None  # the code snapshot its job imports (slurm)

    @property
    def name(self) -> str:
        return f"sweep point #{self.num} ({' '.join(self.overrides) or 'no overrides'})"

    @property
    def files(self) -> Path:
        return self.run_dir / POINT_DIR


def task_config(config: DictConfig) -> DictConfig:
    """The config the task function sees: everything but the hydra node."""
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return task_cfg


class CompositionCache:
    """Keeps the configs Hydra's sweeper composes to validate a batch, for the launcher to reuse.

    BasicSweeper composes every point of a batch (``validate_batch_is_legal``), throws the configs
    away, and hands the batch to the launcher, which must compose each point again: about 60 ms a
    point for a small app, twice. Installed over the shared HydraContext's loader in the launcher's
    ``setup()``, this keeps each composition until :func:`prepare_point` takes it (once: taken
    configs are dropped). Everything else is passed through to Hydra's loader.
    """

    def __init__(self, loader: ConfigLoader) -> None:
        self.loader = loader
        self._kept: dict[tuple[int, tuple[str, ...]], DictConfig] = {}
        self._validated: dict[int, int] = {}  # sweep (master config) -> points composed so far

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        # The sweeper validates points in job order, so this count is the failing point's number.
        num = self._validated.get(id(master_config), 0)
        self._validated[id(master_config)] = num + 1
        try:
            config = self.loader.load_sweep_config(master_config, sweep_overrides)
        except (HydraException, OmegaConfBaseException) as e:
            # Hydra's own message names the key; with many points the user also needs which one.
            raise SweepError(f"sweep point #{num} ({' '.join(sweep_overrides)}): {e}") from e
        self._kept[(id(master_config), tuple(sweep_overrides))] = config
        return config

    def take(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        kept = self._kept.pop((id(master_config), tuple(sweep_overrides)), None)
        return kept if kept is not None else self.loader.load_sweep_config(master_config, sweep_overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def install_composition_cache(hydra_context: HydraContext) -> None:
    if not isinstance(hydra_context.config_loader, CompositionCache):
        hydra_context.config_loader = cast("ConfigLoader", CompositionCache(hydra_context.config_loader))


def _compose(hydra_context: HydraContext, master: DictConfig, overrides: list[str]) -> DictConfig:
    loader: Any = hydra_context.config_loader
    if isinstance(loader, CompositionCache):
        return loader.take(master, overrides)
    return cast(DictConfig, loader.load_sweep_config(master, overrides))


def prepare_point(settings: LauncherSettings, hydra_context: HydraContext, master: DictConfig,
                  overrides: list[str], num: int, sweep_dir: Path) -> Point:
    where = f"sweep point #{num} ({' '.join(overrides) or 'no overrides'})"
    try:
        config = _compose(hydra_context, master, overrides)
    except Exception as e:  # Hydra raises several types for a bad override; all mean the same here
        raise SweepError(f"{where}: {e}") from e
    try:
        run_dir = resolve_point(config, num, sweep_dir)
        task_cfg = task_config(config)
        groups = check_app_config(task_cfg)
        resources = resources_for(settings, groups)
    except (ConfigError, SweepError) as e:
        raise SweepError(f"{where}: {e}") from e
    except Exception as e:  # an interpolation or resolver that fails: name the point, keep the cause
        raise SweepError(f"{where}: {type(e).__name__}: {e}") from e
    steps = OmegaConf.select(task_cfg, "optim.max_steps", default=None)
    return Point(num, list(overrides), config, task_cfg, run_dir, resources, groups is not None,
                 steps if isinstance(steps, int) else None)


def resolve_point(config: DictConfig, num: int, sweep_dir: Path) -> Path:
    """Fix the job number and directories, then resolve every interpolation in place.

    Directories become absolute so that a resubmission from another working directory, or a node
    whose job starts elsewhere, writes to the same place.
    """
    from hydra.core.hydra_config import HydraConfig

    previous = HydraConfig.instance().cfg
    try:
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.job.num = num
            config.hydra.job.id = f"pending_{num}"  # the SLURM id replaces it on the node
        subdir = str(OmegaConf.select(config, "hydra.sweep.subdir"))
        run_dir = (sweep_dir / subdir).absolute()
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = str(sweep_dir)
            config.hydra.sweep.subdir = subdir
            config.hydra.runtime.output_dir = str(run_dir)
        # ${hydra:...} resolves against this point. set_config() would first copy the hydra node
        # (tens of ms per point); the resolver only reads .hydra, which the full config has.
        HydraConfig.instance().cfg = cast(Any, config)
        with read_write(config), read_write(config.hydra):
            OmegaConf.resolve(config)
    finally:
        HydraConfig.instance().cfg = previous
    return run_dir


def take_snapshots(points: Sequence[Point]) -> None:
    """Each SLURM point's code snapshot, its ranks pointed at it through the array's setup lines
    (kept in the registry's resources, so ``resubmit`` runs the same code). Points that name the
    same code share one snapshot, taken once: a 1,000-point sweep hashes its files once."""
    taken: dict[str, snapshot.Snapshot] = {}
    for p in points:
        config = snapshot_config(p.task_cfg)
        if p.resources.executor != "slurm" or not config.enabled:
            continue
        targets = snapshot.targets(p.task_cfg)
        key = json.dumps([asdict(config), targets])
        if key not in taken:
            try:
                taken[key] = snapshot.take(config, targets)
            except ConfigError as e:
                raise SweepError(f"{p.name}: {e}") from e
        p.code = taken[key]
        setup = [*snapshot.setup_lines(p.code), *p.resources.params.get("setup", [])]
        p.resources = replace(p.resources, params={**p.resources.params, "setup": setup})


def snapshot_config(task_cfg: DictConfig) -> SnapshotConfig:
    """The app's ``cluster.snapshot``; any other Hydra app gets the defaults."""
    node = OmegaConf.select(task_cfg, "cluster.snapshot", default=None)
    if isinstance(node, DictConfig) and OmegaConf.get_type(node) is SnapshotConfig:
        return cast(SnapshotConfig, _typed(node, SnapshotConfig))
    return SnapshotConfig()


def check_app_config(task_cfg: DictConfig) -> tuple[ClusterConfig, ParallelismConfig] | None:
    """The app's own checks; returns its cluster/parallelism groups when it has Switchyard's."""
    cluster, parallelism = task_cfg.get("cluster"), task_cfg.get("parallelism")
    if not (isinstance(cluster, DictConfig) and isinstance(parallelism, DictConfig)
            and OmegaConf.get_type(cluster) is ClusterConfig
            and OmegaConf.get_type(parallelism) is ParallelismConfig):
        return None
    check = app_check(OmegaConf.get_type(task_cfg))
    if check is not None:
        # jobs.train's ranks skip its checks (they trust the launcher), so its registered check runs
        # here: schema, dataset (the demo one is generated now, once), model structure.
        return check(task_cfg)
    return _typed(cluster, ClusterConfig), _typed(parallelism, ParallelismConfig)


def _typed(node: DictConfig, schema: type[Any]) -> Any:
    """A group's dataclass, with its __post_init__ checks run (as jobs.train.load_config does)."""
    try:
        value = OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else None
        raise cause or ConfigError(str(e)) from e
    if not isinstance(value, schema):
        raise ConfigError(f"expected a {schema.__name__}, got {type(value).__name__}")
    return value


def check_sweep_dir(sweep_dir: Path) -> None:
    """The points' log paths (``SWEEP/.submitit/%j``) go into ``#SBATCH --output``, where sbatch
    expands every ``%``: a ``%`` of the sweep directory's own sends the logs where submitit and
    ``switchyard logs`` never look (``sw%4`` became ``sw404_0``)."""
    if "%" in str(sweep_dir):
        raise SweepError(f"hydra.sweep.dir={str(sweep_dir)!r} is invalid: it holds '%', which sbatch "
                         f"expands in log file names (%j: job id), so the jobs' logs and results would "
                         f"land elsewhere; nothing was queued (try hydra.sweep.dir=<a path without %>)")


def check_cluster_limits(num_jobs: int) -> slurm_query.ClusterLimits:
    """Refuse, before anything is queued, ``num_jobs`` more jobs than SLURM would take.

    slurmctld counts every task of an array against ``MaxJobCount`` from submission on (pending
    ones too), so the sweep must fit beside the jobs it already holds; past that, sbatch refuses
    an array and the sweep would be queued in part. ``MaxArraySize`` 0 means no arrays at all.
    """
    try:
        limits = slurm_query.cluster_limits()
        held = slurm_query.jobs_in_controller()
    except slurm_query.SlurmQueryError as e:
        raise SweepError(f"cannot read SLURM's limits ({e}); is the cluster up? "
                         f"(try switchyard cluster up)") from e
    if limits.max_array_size < 1:
        raise SweepError(f"this cluster disables job arrays (MaxArraySize={limits.max_array_size} in "
                         f"scontrol show config), and Switchyard submits sweeps as arrays: nothing "
                         f"was queued (run the points one by one without -m)")
    room = max(limits.max_job_count - 1 - held, 0)
    if num_jobs > room:
        raise SweepError(
            f"{num_jobs} jobs do not fit in SLURM: MaxJobCount={limits.max_job_count} (scontrol show "
            f"config) counts every array task, queued ones too, and the controller holds {held} jobs "
            f"now, so {room} more fit; nothing was queued. Sweep at most {room} points at a time, or "
            f"wait for queued jobs to end (hydra.launcher.array_parallelism limits how many tasks "
            f"run at once, not how many SLURM counts)")
    return limits


def array_chunks(num_points: int, max_array_size: int | None) -> list[range]:
    """Consecutive slices of a group's points, one array each: at most ``max_array_size`` points
    (array indices run 0..MaxArraySize-1), as few arrays as that allows."""
    size = max_array_size if max_array_size else max(num_points, 1)
    return [range(start, min(start + size, num_points)) for start in range(0, num_points, size)]


def parallelism_share(array_parallelism: int, num_arrays: int) -> int:
    """Each array's ``%N`` when a group is split: the arrays run side by side, so together they
    keep to the group's array_parallelism (at least 1 each)."""
    return max(array_parallelism // max(num_arrays, 1), 1)


def _max_array_size(resources: Resources) -> int | None:
    if resources.executor != "slurm":
        return None  # local jobs: no array limit
    return slurm_query.cluster_limits().max_array_size  # cached: asked once per process


def check_partitions(points: Sequence[Point]) -> None:
    """One ``sinfo`` call: every partition a point names must exist."""
    wanted = {p.resources.params.get("partition") for p in points} - {None}
    if not wanted:
        return
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SweepError(f"cannot list SLURM partitions (sinfo: {e}); is the cluster up? "
                         f"(try switchyard cluster up)") from e
    known = sorted(set(out.split()))
    for p in points:
        partition = p.resources.params.get("partition")
        if partition is not None and partition not in known:
            raise SweepError(f"{p.name}: {p.resources.source}.partition={partition!r} is invalid: "
                             f"no such partition (partitions: {', '.join(known)}) "
                             f"(try {p.resources.source}.partition={known[0] if known else 'null'})")


# ------------------------------------------------------------------------------------------------
# Files: written at submit time, read by the tasks and by `switchyard show/resubmit`


def _write_bytes(path: Path, data: bytes, durable: bool = False) -> None:
    """Whole or absent (orchestrator.atomic). Submit-time files skip the directory fsync: if the
    submit host crashes, resubmitting writes them again."""
    with atomic.atomic_write(path, binary=True, durable=durable) as f:
        f.write(data)


def write_entry(sweep_dir: Path, task_function: Callable[..., Any], hydra_context: HydraContext
                ) -> Path:
    """The task function, Hydra's context and Hydra's global state, pickled once per sweep."""
    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.types import HydraContext

    loader: Any = hydra_context.config_loader
    if isinstance(loader, CompositionCache):  # the tasks need Hydra's loader, not our cache
        hydra_context = HydraContext(config_loader=loader.loader, callbacks=hydra_context.callbacks)
    path = sweep_dir / SWEEP_ENTRY
    _write_bytes(path, cloudpickle.dumps((task_function, hydra_context, Singleton.get_state())))
    return path


def write_point(point: Point, entry: Path, origin: provenance.Origin, diff: Path | None) -> None:
    import cloudpickle  # by value for schemas defined in a script's __main__

    config_yaml = OmegaConf.to_yaml(point.task_cfg)
    _write_bytes(point.files / "config.pkl", cloudpickle.dumps(point.config))
    _write_bytes(point.files / "config.yaml", config_yaml.encode())
    provenance.record(point.run_dir, point.code, config_yaml, origin, diff)
    spec = {"num": point.num, "overrides": point.overrides, "entry": str(entry), "ddp": point.is_ddp}
    _write_bytes(point.files / "point.json", json.dumps(spec, indent=1).encode())


# ------------------------------------------------------------------------------------------------
# Node side


def run_point(run_dir: str) -> JobReturn:
    """What every task of a point's job runs: the saved config, through Hydra's ``run_job``."""
    import cloudpickle
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job, setup_globals

    files = Path(run_dir) / POINT_DIR
    spec = json.loads((files / "point.json").read_text())
    task_function, hydra_context, singleton_state = cloudpickle.loads(Path(spec["entry"]).read_bytes())
    Singleton.set_state(singleton_state)
    setup_globals()
    config = cloudpickle.loads((files / "config.pkl").read_bytes())
    env = dist_env.detect()
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.job.id = env.job_id
        if env.rank != 0:
            config.hydra.output_subdir = None  # one copy of .hydra/, written by rank 0
    if spec["ddp"]:
        os.environ[dist_env.IN_JOB_ENV] = "1"  # jobs.train: train here, this task is one rank
    report = TaskStatus(job_id=env.job_id, started_at=time.time(), restarts=env.restart_count,
                        node=env.hostname)
    if env.is_main:
        report.write(run_dir)
    ret = _run_reporting(lambda: run_job(hydra_context=hydra_context, task_function=task_function,
                                         config=config, job_dir_key="hydra.sweep.dir",
                                         job_subdir_key="hydra.sweep.subdir"),
                         report, run_dir, env.is_main)
    if ret.status == JobStatus.FAILED:
        error = ret._return_value
        raise PointFailed(f"sweep point #{spec['num']} ({' '.join(spec['overrides'])}) failed: "
                          f"{type(error).__name__}: {error}") from error
    return ret


def _run_reporting(run: Callable[[], JobReturn], report: TaskStatus, run_dir: str,
                   is_main: bool) -> JobReturn:
    """Run, then (rank 0) save the JobReturn and the end report. A stop for requeue/preemption
    writes no end: the attempt is not over."""
    import cloudpickle
    from hydra.core.utils import JobStatus

    from orchestrator.launch.rank_env import AttemptNotOver
    from orchestrator.training.preemption import JobStopped

    try:
        ret = run()
    except (JobStopped, AttemptNotOver):
        raise
    except SystemExit as e:  # the app called sys.exit
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if is_main:
            _end(report, run_dir, code, f"exited with status {code}" if code else None)
        raise
    if is_main:
        failed = ret.status == JobStatus.FAILED
        try:
            _write_bytes(result_path(run_dir, report.job_id), cloudpickle.dumps(ret), durable=True)
        except Exception as e:  # an unpicklable return value must not turn success into failure
            log.warning(f"could not save the job's return value: {e}")
        error = ret._return_value if failed else None
        _end(report, run_dir, 1 if failed else 0,
             f"{type(error).__name__}: {error}".splitlines()[0][:500] if failed else None)
    return ret


def _end(report: TaskStatus, run_dir: str, code: int, error: str | None) -> None:
    TaskStatus(**{**report.__dict__, "ended_at": time.time(), "exit_code": code,
                  "error": error}).write(run_dir)


def result_path(run_dir: str | Path, job_id: str) -> Path:
    return Path(run_dir) / POINT_DIR / "results" / f"{job_id}.pkl"


# ------------------------------------------------------------------------------------------------
# Submission


@dataclass
class SweepState:
    """Kept by the launcher across Hydra's batches of one sweep (max_batch_size)."""

    sweep_id: int | None = None
    entry: Path | None = None


@dataclass
class Launched:
    point: Point
    job: submitit.Job[Any]


def group_points(points: Sequence[Point]) -> list[list[Point]]:
    """Points with equal resource requests, in job order: one array each."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(p.resources.key(), []).append(p)
    return list(groups.values())


def make_executor(resources: Resources, folder: Path) -> submitit.Executor:
    import submitit

    if resources.executor == "local":
        local = submitit.LocalExecutor(folder=folder)
        local.update_parameters(**resources.params)
        return local
    slurm = submitit.SlurmExecutor(folder=folder, max_num_timeout=resources.max_requeues)
    slurm.update_parameters(**resources.params, array_parallelism=resources.array_parallelism)
    return slurm


def submit_array(registry: Registry, sweep_id: int, resources: Resources, run_dirs: dict[int, str],
                 folder: Path) -> list[submitit.Job[Any]]:
    """Claim attempts, one sbatch for all of ``run_dirs`` ({num: run dir}), confirm the ids."""
    claims = registry.claim(sweep_id, run_dirs)
    return _submit_claimed(registry, claims, resources, list(run_dirs.values()), folder)


def _submitted(attempt_id: int, job: submitit.Job[Any]) -> Submitted:
    array_id, _, index = str(job.job_id).partition("_")
    return Submitted(attempt_id, str(job.job_id), array_id if index else None,
                     int(index) if index else None, str(job.paths.folder))


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
    sweep_dir = Path(str(master.hydra.sweep.dir)).absolute()
    if settings.executor == "slurm":
        check_sweep_dir(sweep_dir)
    points = [prepare_point(settings, hydra_context, master, list(overrides), initial_job_idx + i,
                            sweep_dir) for i, overrides in enumerate(job_overrides)]
    if settings.executor == "slurm":
        check_partitions(points)
        check_cluster_limits(len(points))
    _warn_ignored_resources(settings, points)
    take_snapshots(points)
    origin = provenance.origin()
    diff = provenance.write_diff(sweep_dir, origin)  # once per submission, named by every point
    wait = settings.wait if settings.wait is not None else _app_wait(points)
    try:
        with Registry(settings.registry) as registry, damage_reported(registry.path):
            if state.sweep_id is None:  # Hydra's later batches of the same sweep join it
                state.entry = write_entry(sweep_dir, task_function, hydra_context)
                state.sweep_id = registry.create_sweep(
                    app=str(master.hydra.job.name), command=sweep_command(master),
                    sweep_dir=str(sweep_dir), executor=settings.executor, entry_path=str(state.entry))
            for p in points:
                write_point(p, cast(Path, state.entry), origin, diff)
            registry.add_jobs(Job(state.sweep_id, p.num, p.overrides, str(p.run_dir), asdict(p.resources),
                                  p.total_steps) for p in points)
            return _submit_and_wait(settings, registry, state.sweep_id, points, sweep_dir, wait)
    except RegistryError as e:  # unreadable or damaged: Hydra prints a SweepError as one line
        raise SweepError(str(e)) from e


def _submit_and_wait(settings: LauncherSettings, registry: Registry, sweep_id: int,
                     points: Sequence[Point], sweep_dir: Path, wait: bool) -> list[JobReturn]:
    groups, folder = group_points(points), sweep_dir / SUBMITIT_FOLDER
    num_arrays = sum(len(array_chunks(len(g), _max_array_size(g[0].resources))) for g in groups)
    log.info(f"Switchyard: sweep {sweep_id}: {len(points)} jobs in {num_arrays} "
             f"{'array' if settings.executor == 'slurm' else 'group'}(s) -> {sweep_dir}")
    for p in points:
        log.info(f"\t#{p.num} : {' '.join(p.overrides)}")
    where = f" --registry {settings.registry}" if settings.registry else ""
    try:
        if settings.executor == "local" and wait:
            launched = _run_local_window(registry, sweep_id, groups, folder, settings.poll_s)
        elif settings.executor == "local":  # not waiting: the controllers must not hold our pipes
            with local_jobs.detached_output(sweep_dir / LOCAL_CONTROLLER_LOG):
                launched = _submit_all(registry, sweep_id, groups, folder)
        else:
            launched = _submit_all(registry, sweep_id, groups, folder)
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


def _submit_all(registry: Registry, sweep_id: int, groups: list[list[Point]], folder: Path
                ) -> list[Launched]:
    launched: list[Launched] = []
    for i, group in enumerate(groups):
        try:
            jobs = submit_array(registry, sweep_id, group[0].resources,
                                {p.num: str(p.run_dir) for p in group}, folder)
        except Exception as e:
            num_queued = len(launched) + len(e.queued if isinstance(e, SubmitError) else [])
            queued = f"; {num_queued} jobs of sweep {sweep_id} were already queued " \
                     f"(switchyard cancel {sweep_id})" if num_queued else ""
            raise SweepError(f"submitting group {i + 1}/{len(groups)} ({group[0].name} and "
                             f"{len(group) - 1} more) failed: {e}{queued}") from e
        launched += [Launched(p, j) for p, j in zip(group, jobs, strict=True)]
    return sorted(launched, key=lambda item: item.point.num)


def _run_local_window(registry: Registry, sweep_id: int, groups: list[list[Point]], folder: Path,
                      poll_s: float) -> list[Launched]:
    """Local and blocking: at most array_parallelism points run at once (each is a whole job)."""
    waiting = deque(p for group in groups for p in group)
    running: list[Launched] = []
    launched: list[Launched] = []
    while waiting or running:
        while waiting and len(running) < waiting[0].resources.array_parallelism:
            p = waiting.popleft()
            job = submit_array(registry, sweep_id, p.resources, {p.num: str(p.run_dir)}, folder)[0]
            running.append(Launched(p, job))
            launched.append(running[-1])
        time.sleep(min(poll_s, 0.2))
        running = [item for item in running if not item.job.done()]
    return sorted(launched, key=lambda item: item.point.num)


def _print_submitted(sweep_id: int, launched: Sequence[Launched], registry_path: str | None) -> None:
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


def submitted_return(item: Launched, sweep_id: int) -> JobReturn:
    """Non-blocking: the job is queued, which is all this process will know."""
    from hydra.core.utils import JobStatus

    return _job_return(item.point, JobStatus.COMPLETED,
                       {"sweep_id": sweep_id, "job": f"{sweep_id}/{item.point.num}",
                        "slurm_id": str(item.job.job_id)})


def outcome(item: Launched) -> JobReturn:
    """Blocking: rank 0's JobReturn; for a failure, the task's own exception when it got to
    report one, else a JobFailedError naming the rank, node and log tail."""
    import cloudpickle
    from hydra.core.utils import JobStatus

    from orchestrator.launch import submit

    try:
        return cast("JobReturn", submit.results(item.job, item.point.run_dir)[0])
    except submit.JobFailedError as e:
        saved = result_path(item.point.run_dir, str(item.job.job_id))
        if saved.exists():
            try:
                return cast("JobReturn", cloudpickle.loads(saved.read_bytes()))
            except Exception:  # the exception's class cannot be rebuilt here: report the logs
                pass
        return _job_return(item.point, JobStatus.FAILED, e)


def _settle(registry: Registry, sweep_id: int, timeout_s: float = 30.0) -> None:
    """After a blocking wait: give sacct a moment to record the ends, so the registry is final,
    then keep what each ended job left in it, so the first ``status`` after reads no job files."""
    from orchestrator.sweeps.status import keep_ended_results

    deadline = time.monotonic() + timeout_s
    while True:
        reconciled = reconcile(registry, [sweep_id])
        if not registry.unsettled([sweep_id]) or time.monotonic() > deadline:
            for warning in reconciled.warnings:
                log.warning(f"Switchyard: {warning}")
            keep_ended_results(registry, sweep_id)
            return
        time.sleep(0.5)


def resubmit_failed(registry: Registry, sweep_id: int) -> list[tuple[Job, str]]:
    """Every job of the sweep whose latest attempt failed, timed out or was cancelled, submitted
    again from its saved config as a new array per resource group: ``[(job, new id)]``."""
    sweep = registry.sweep(sweep_id)
    if sweep.executor == "slurm":  # the retries must fit too, checked before any is claimed
        latest = registry.latest_attempts(sweep_id).values()
        check_cluster_limits(sum(a.state in RETRY_STATES for a in latest))
    claims = registry.claim_retries(sweep_id)
    jobs = {j.num: j for j in registry.jobs(sweep_id)}
    by_resources: dict[str, list[Job]] = {}
    for num in sorted(claims):
        by_resources.setdefault(json.dumps(jobs[num].resources, sort_keys=True), []).append(jobs[num])
    folder = Path(sweep.sweep_dir) / SUBMITIT_FOLDER
    out: list[tuple[Job, str]] = []
    for key, group in by_resources.items():
        try:
            executor_jobs = _submit_claimed(registry, {j.num: claims[j.num] for j in group},
                                            Resources.from_json(json.loads(key)),
                                            [j.run_dir for j in group], folder)
        except Exception as e:
            left = [claims[n] for n in claims if n not in {j.num for j, _ in out} | {j.num for j in group}]
            registry.fail_claims(left, "not submitted: an earlier array of this resubmission failed")
            num_done = len(out) + len(e.queued if isinstance(e, SubmitError) else [])
            done = f" ({num_done} jobs were resubmitted before it)" if num_done else ""
            raise SweepError(f"resubmitting {' '.join(j.ref for j in group)} failed: {e}{done}") from e
        out += [(j, str(sj.job_id)) for j, sj in zip(group, executor_jobs, strict=True)]
    return out


class SubmitError(RuntimeError):
    """sbatch refused one array of a group split at MaxArraySize; ``queued`` went out before it."""

    def __init__(self, cause: Exception, queued: list[submitit.Job[Any]]) -> None:
        super().__init__(str(cause))
        self.queued = queued


def _submit_claimed(registry: Registry, claims: dict[int, int], resources: Resources,
                    run_dirs: list[str], folder: Path) -> list[submitit.Job[Any]]:
    """One sbatch per MaxArraySize points; each array confirmed in the registry as it is queued."""
    from orchestrator.launch.submit import RankEntry  # each rank's log starts with its rank and node name

    attempt_ids = list(claims.values())
    chunks = array_chunks(len(run_dirs), _max_array_size(resources))
    share = parallelism_share(resources.array_parallelism, len(chunks))
    executor = make_executor(replace(resources, array_parallelism=share), folder)
    jobs: list[submitit.Job[Any]] = []
    for chunk in chunks:
        try:
            part = executor.map_array(RankEntry(run_point), run_dirs[chunk.start:chunk.stop])
        except Exception as e:
            registry.fail_claims(attempt_ids[chunk.start:], str(e))  # this array and the ones after
            if jobs:
                raise SubmitError(e, jobs) from e
            raise
        registry.confirm(_submitted(a, j) for a, j in zip(attempt_ids[chunk.start:chunk.stop], part,
                                                          strict=True))
        jobs += part
    return jobs
