"""A sweep's points, composed, resolved and checked before anything is queued.

1. compose every point here, once, with Hydra's own loader (reusing what the sweeper composed,
   :class:`CompositionCache`); give it its job number and run directory, and resolve every
   interpolation. Nothing is composed on the node, so editing YAML while the sweep waits in the
   queue changes nothing.
2. check every point: the app's typed config (``jobs.train``: schema checks, dataset, model) and
   the launcher's resources; errors name the point.
3. snapshot the code each SLURM point imports (``launch.snapshot``), once per distinct code.
4. write what its job loads into the point's run directory (``RUN/.switchyard/config.pkl``;
   ``config.yaml`` beside it for people; its provenance), and the task function once per sweep.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config import (
    AppGroups,
    ClusterConfig,
    ConfigError,
    ParallelismConfig,
    SnapshotConfig,
    app_check,
)
from orchestrator.launch import container, ownership, provenance, signal_delay, snapshot
from orchestrator.sweeps.arrays import LauncherSettings, Resources, SweepError, resources_for
from orchestrator.sweeps.node import POINT_DIR, write_bytes

if TYPE_CHECKING:
    from hydra.core.config_loader import ConfigLoader
    from hydra.types import HydraContext

SWEEP_ENTRY = ".switchyard/entry.pkl"  # inside the sweep directory


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
    cluster: ClusterConfig | None = None  # the app's cluster group, when it has one (its container)

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
    from orchestrator import library_versions
    if not library_versions.hooks_allowed("hydra-core"):
        return  # each point is composed again by Hydra's own loader
    if not isinstance(hydra_context.config_loader, CompositionCache):
        hydra_context.config_loader = cast("ConfigLoader", CompositionCache(hydra_context.config_loader))


def _compose(hydra_context: HydraContext, master: DictConfig, overrides: list[str]) -> DictConfig:
    loader: Any = hydra_context.config_loader
    if isinstance(loader, CompositionCache):
        return loader.take(master, overrides)
    return cast(DictConfig, loader.load_sweep_config(master, overrides))


def prepare_point(settings: LauncherSettings, hydra_context: HydraContext, master: DictConfig,
                  overrides: list[str], num: int, sweep_dir: Path,
                  dirs: ownership.SweepDirs | None = None) -> Point:
    """``dirs``: the run directories of the sweep's points so far; this point's is checked
    against them, and for what it holds, before anything is written there."""
    where = f"sweep point #{num} ({' '.join(overrides) or 'no overrides'})"
    try:
        config = _compose(hydra_context, master, overrides)
    except Exception as e:  # Hydra raises several types for a bad override; all mean the same here
        raise SweepError(f"{where}: {e}") from e
    try:
        run_dir = resolve_point(config, num, sweep_dir)
        if dirs is not None:
            dirs.check(where, run_dir)
        task_cfg = task_config(config)
        groups = check_app_config(task_cfg)
        if groups is not None:  # cluster.signal_delay_s=auto: from this point's own last run
            delay = signal_delay.at_submission(groups.cluster, run_dir, announce=False)
            groups = replace(groups, cluster=delay)
        resources = resources_for(settings, groups)
    except (ConfigError, SweepError) as e:
        raise SweepError(f"{where}: {e}") from e
    except Exception as e:  # an interpolation or resolver that fails: name the point, keep the cause
        raise SweepError(f"{where}: {type(e).__name__}: {e}") from e
    steps = OmegaConf.select(task_cfg, "optim.max_steps", default=None)
    return Point(num, list(overrides), config, task_cfg, run_dir, resources, groups is not None,
                 steps if isinstance(steps, int) else None, cluster=groups.cluster if groups else None)


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
        ownership.check_path(subdir, "hydra.sweep.subdir")  # empty: the sweep's own directory
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


# Keys of an app's config whose paths its ranks read or write (jobs.train's), mounted into the
# container of a point that names one.
CONTAINER_PATH_KEYS = ("data.path", "data.eval_path", "data.cache_dir", "checkpoint.dir",
                       "checkpoint.resume_from")
CONTAINER_MADE_KEYS = ("checkpoint.dir",)  # made at submission, to be mounted at its own path


def add_containers(points: Sequence[Point], sweep_dir: Path) -> None:
    """The container arguments of each SLURM point with ``cluster.container`` (after
    ``take_snapshots``): the sweep's directory is mounted (the run directories in it with it), so
    points that differ only in their overrides still share one array; a point whose run directory
    lies elsewhere (``hydra.sweep.subdir`` an absolute path) has it mounted too."""
    boxed = [(p, p.cluster) for p in points if p.resources.executor == "slurm" and p.cluster is not None
             and p.cluster.container.runtime != "none"]
    if not boxed:
        return
    from orchestrator.launch.container import Need
    from orchestrator.launch.submit import container_parameters  # imports submitit

    sweep_dir.mkdir(parents=True, exist_ok=True)
    for p, cluster in boxed:
        paths = [Need(key, OmegaConf.select(p.task_cfg, key, default=None), made=key in CONTAINER_MADE_KEYS)
                 for key in CONTAINER_PATH_KEYS]
        if not Path(p.run_dir).absolute().is_relative_to(sweep_dir):
            Path(p.run_dir).mkdir(parents=True, exist_ok=True)
            paths.append(Need("hydra.sweep.subdir", p.run_dir))
        try:
            gpus = int(p.resources.params.get("gpus_per_node") or 0)
            params = container_parameters(cluster, ParallelismConfig(gpus_per_node=gpus), sweep_dir,
                                          p.code, paths, p.resources.params.get("setup", []),
                                          run_key="hydra.sweep.dir")
        except ConfigError as e:
            raise SweepError(f"{p.name}: {e}") from e
        p.resources = replace(p.resources, params={**p.resources.params, **params})


def user_packages(points: Sequence[Point], task_function: Callable[..., Any]) -> dict[str, str]:
    """The installed packages the sweep's own code imports (``provenance.user_packages``): the
    points' model and task targets, and the app's own script (its task function's file)."""
    targets = sorted({t for p in points for t in snapshot.targets(p.task_cfg)})
    try:
        scripts = [Path(inspect.getfile(task_function))]
    except TypeError:  # a built-in or a callable object: no file of its own
        scripts = []
    return provenance.user_packages(snapshot_config(points[0].task_cfg), targets, scripts)


def snapshot_config(task_cfg: DictConfig) -> SnapshotConfig:
    """The app's ``cluster.snapshot``; any other Hydra app gets the defaults."""
    node = OmegaConf.select(task_cfg, "cluster.snapshot", default=None)
    if isinstance(node, DictConfig) and OmegaConf.get_type(node) is SnapshotConfig:
        return cast(SnapshotConfig, _typed(node, SnapshotConfig))
    return SnapshotConfig()


def check_app_config(task_cfg: DictConfig) -> AppGroups | None:
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
    return AppGroups(_typed(cluster, ClusterConfig), _typed(parallelism, ParallelismConfig))


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
    write_bytes(path, cloudpickle.dumps((task_function, hydra_context, Singleton.get_state())))
    return path


def write_point(point: Point, entry: Path, origin: provenance.Origin, diff: Path | None
                ) -> dict[str, Any]:
    """The point's files; returns its provenance (what ``provenance.json`` says it runs)."""
    import cloudpickle  # by value for schemas defined in a script's __main__

    config_yaml = OmegaConf.to_yaml(point.task_cfg)
    write_bytes(point.files / "config.pkl", cloudpickle.dumps(point.config))
    write_bytes(point.files / "config.yaml", config_yaml.encode())
    image = container.identity(point.cluster.container) if point.cluster is not None else None
    recorded = provenance.record(point.run_dir, point.code, config_yaml, origin, diff, image)
    spec = {"num": point.num, "overrides": point.overrides, "entry": str(entry), "ddp": point.is_ddp}
    write_bytes(point.files / "point.json", json.dumps(spec, indent=1).encode())
    return recorded

