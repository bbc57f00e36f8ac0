"""A sweep's points as job arrays: what each point asks of the executor (:class:`Resources`), the
checks against SLURM's limits before anything is queued, the grouping of equal requests into one
``sbatch --array=0-N%array_parallelism`` each (several where a group has more points than
``MaxArraySize``), their submission and the resubmission of failed jobs.

Points with equal resources share one array; :func:`group_key` is the one key that says so, for a
new sweep (:func:`group_points`) and for a resubmission (:func:`resubmit_failed`) alike. Executors
come from ``launch.submit.new_executor``, the factory single jobs use too.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from hydra.errors import CompactHydraException
from omegaconf import OmegaConf

from orchestrator.config import AppGroups, ClusterConfig, ConfigError, ParallelismConfig
from orchestrator.launch import bad_nodes, slurm_query
from orchestrator.registry.db import Attempt, Job, Registry, Submitted
from orchestrator.registry.states import RETRY_STATES
from orchestrator.sweeps.node import run_point

if TYPE_CHECKING:
    import submitit

log = logging.getLogger(__name__)

EXECUTORS = ("slurm", "local")
SUBMITIT_FOLDER = ".submitit/%j"  # inside the sweep directory; one folder per array task


class SweepError(CompactHydraException, ValueError):
    """Bad input found before anything was queued; the message names the point and a fix.

    A CompactHydraException: Hydra prints the message alone, as for its own composition errors.
    """



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
    max_excluded_nodes: int = 2  # cluster.max_excluded_nodes: a retry avoids at most this many nodes
    # Imported once per node before the ranks are forked (launch/fork_start.py); empty: each rank
    # starts as its own process (an app without them, cluster.rank_start=spawn). Recorded by older
    # versions without it.
    rank_modules: list[str] = field(default_factory=list)
    # The point's process runs only Switchyard's code (AppGroups.own_code): it ends without the
    # interpreter's teardown (launch/job_entry.py). Recorded by older versions without it.
    own_code: bool = False

    def key(self) -> str:
        return group_key(asdict(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Resources:
        return cls(**data)


def resources_for(settings: LauncherSettings, groups: AppGroups | None) -> Resources:
    from orchestrator.launch.submit import local_parameters, slurm_parameters  # imports submitit

    cluster, parallelism = (groups.cluster, groups.parallelism) if groups else _launcher_groups(settings)
    params = local_parameters(cluster, parallelism) if settings.executor == "local" \
        else slurm_parameters(cluster, parallelism)
    forked = [*groups.rank_modules, run_point.__module__] if groups and groups.rank_modules \
        and cluster.forks_ranks and cluster.mode == settings.executor else []
    return Resources(settings.executor, params, cluster.max_requeues, settings.array_parallelism,
                     "cluster" if groups else "hydra.launcher", cluster.max_excluded_nodes, forked,
                     own_code=groups is not None and groups.own_code)


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



def group_key(resources: dict[str, Any]) -> str:
    """Equal keys, one array: a Resources as a dict (as the registry keeps it for resubmit)."""
    return json.dumps(resources, sort_keys=True)


class SweepPoint(Protocol):
    """What submission needs of a point (``points.Point``)."""

    @property
    def num(self) -> int: ...  # hydra.job.num

    @property
    def run_dir(self) -> Path: ...

    @property
    def resources(self) -> Resources: ...

    @property
    def name(self) -> str: ...  # "sweep point #N (overrides)", for messages


P = TypeVar("P", bound=SweepPoint)


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


def check_local_window(num_points: int, array_parallelism: int) -> None:
    """Local jobs have no queue: whatever a sweep that does not wait submits starts at once, so
    only a blocking local sweep can keep to array_parallelism (run_local_window). One that would
    run more points at once than that is refused before anything starts (it ran them all)."""
    if num_points > array_parallelism:
        raise SweepError(
            f"{num_points} local jobs with hydra.launcher.array_parallelism={array_parallelism} and "
            f"hydra.launcher.wait=false: this machine has no queue to hold the rest, so all "
            f"{num_points} would run at once; nothing was started (try hydra.launcher.wait=true, "
            f"which runs at most {array_parallelism} at a time, or "
            f"hydra.launcher.array_parallelism={num_points} to run them all at once)")


def array_chunks(num_points: int, max_array_size: int | None) -> list[range]:
    """Consecutive slices of a group's points, one array each: at most ``max_array_size`` points
    (array indices run 0..MaxArraySize-1), as few arrays as that allows."""
    size = max_array_size if max_array_size else max(num_points, 1)
    return [range(start, min(start + size, num_points)) for start in range(0, num_points, size)]


def parallelism_share(array_parallelism: int, num_arrays: int) -> int:
    """Each array's ``%N`` when a group is split: the arrays run side by side, so together they
    keep to the group's array_parallelism (at least 1 each)."""
    return max(array_parallelism // max(num_arrays, 1), 1)


def max_array_size(resources: Resources) -> int | None:
    if resources.executor != "slurm":
        return None  # local jobs: no array limit
    return slurm_query.cluster_limits().max_array_size  # cached: asked once per process


def check_partitions(points: Sequence[SweepPoint]) -> None:
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



@dataclass
class Launched(Generic[P]):
    point: P
    job: submitit.Job[Any]


def group_points(points: Sequence[P]) -> list[list[P]]:
    """Points with equal resource requests, in job order: one array each."""
    groups: dict[str, list[P]] = {}
    for p in points:
        groups.setdefault(p.resources.key(), []).append(p)
    return list(groups.values())


def make_executor(resources: Resources, folder: Path) -> submitit.Executor:
    from orchestrator.launch.submit import new_executor  # imports submitit

    return new_executor(resources.executor, resources.params, folder, resources.max_requeues,
                        resources.array_parallelism if resources.executor == "slurm" else None,
                        rank_modules=resources.rank_modules, own_code=resources.own_code)


def submit_array(registry: Registry, sweep_id: int, resources: Resources, run_dirs: dict[int, str],
                 folder: Path) -> list[submitit.Job[Any]]:
    """Claim attempts, one sbatch for all of ``run_dirs`` ({num: run dir}), confirm the ids."""
    claims = registry.claim(sweep_id, run_dirs)
    return _submit_claimed(registry, claims, resources, list(run_dirs.values()), folder)


def _submitted(attempt_id: int, job: submitit.Job[Any]) -> Submitted:
    array_id, _, index = str(job.job_id).partition("_")
    return Submitted(attempt_id, str(job.job_id), array_id if index else None,
                     int(index) if index else None, str(job.paths.folder))


def submit_all(registry: Registry, sweep_id: int, groups: list[list[P]], folder: Path
               ) -> list[Launched[P]]:
    launched: list[Launched[P]] = []
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


def run_local_window(registry: Registry, sweep_id: int, groups: list[list[P]], folder: Path,
                     poll_s: float) -> list[Launched[P]]:
    """Local and blocking: at most array_parallelism points run at once (each is a whole job)."""
    waiting = deque(p for group in groups for p in group)
    running: list[Launched[P]] = []
    launched: list[Launched[P]] = []
    while waiting or running:
        while waiting and len(running) < waiting[0].resources.array_parallelism:
            p = waiting.popleft()
            job = submit_array(registry, sweep_id, p.resources, {p.num: str(p.run_dir)}, folder)[0]
            running.append(Launched(p, job))
            launched.append(running[-1])
        time.sleep(min(poll_s, 0.2))
        running = [item for item in running if not item.job.done()]
    return sorted(launched, key=lambda item: item.point.num)



def resubmit_failed(registry: Registry, sweep_id: int) -> list[tuple[Job, str]]:
    """Every job of the sweep whose latest attempt failed, timed out or was cancelled, submitted
    again from its saved config as a new array per resource group: ``[(job, new id)]``. On SLURM
    each retry is kept off the nodes its failed attempts blamed (``left_behind``)."""
    sweep = registry.sweep(sweep_id)
    jobs = {j.num: j for j in registry.jobs(sweep_id)}
    avoid: dict[int, list[dict[str, Any]]] = {}
    if sweep.executor == "slurm":  # the retries must fit too, checked before any is claimed
        latest = registry.latest_attempts(sweep_id)
        failed = {num: a for num, a in latest.items() if a.state in RETRY_STATES}
        check_cluster_limits(len(failed))
        avoid = left_behind(registry, sweep_id, failed, jobs)
        check_nodes_left(jobs, avoid)
    claims = registry.claim_retries(sweep_id)
    registry.record_exclusions({claims[num]: nodes for num, nodes in avoid.items() if num in claims})
    by_resources: dict[str, list[Job]] = {}
    for num in sorted(claims):
        resources = avoiding(jobs[num].resources, [n["node"] for n in avoid.get(num, [])])
        by_resources.setdefault(group_key(resources), []).append(jobs[num])
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


def left_behind(registry: Registry, sweep_id: int, failed: dict[int, Attempt], jobs: dict[int, Job]
                ) -> dict[int, list[dict[str, Any]]]:
    """For each job about to be retried, the nodes its retry avoids (``{num: [{node, why,
    attempt}]}``): those its failed attempt avoided already, then those that attempt blamed
    (``bad_nodes``: a node failure, a rank killed by a signal, a CUDA/NCCL error in a log's tail),
    at most ``cluster.max_excluded_nodes``."""
    earlier = registry.exclusions(sweep_id)
    out: dict[int, list[dict[str, Any]]] = {}
    for num, attempt in failed.items():
        kept = list(earlier.get(attempt.id, []))
        if attempt.slurm_id and attempt.log_dir:
            log_dir = Path(attempt.log_dir)
            for bad in bad_nodes.of_attempt(log_dir, attempt.slurm_id, attempt.state, attempt.node):
                if bad.node not in {k["node"] for k in kept}:
                    kept.append({**bad.as_dict(), "attempt": attempt.attempt})
        cap = Resources.from_json(jobs[num].resources).max_excluded_nodes
        if kept[:cap]:
            out[num] = kept[:cap]
    return out


def avoiding(resources: dict[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """A job's saved resources with ``nodes`` added to its own ``--exclude`` (the job's row keeps
    what the user asked for, so a later retry starts from it again)."""
    if not nodes:
        return resources
    params = resources["params"]
    exclude = bad_nodes.exclude_list(params.get("exclude"), nodes)
    return {**resources, "params": {**params, "exclude": exclude}}


def check_nodes_left(jobs: dict[int, Job], avoid: dict[int, list[dict[str, Any]]]) -> None:
    """A retry that avoids its nodes must still find enough in its partition: refused before
    anything is claimed or queued, naming the nodes and why each is avoided."""
    if not avoid:
        return
    try:
        by_partition = slurm_query.partition_nodes()
        for num, nodes in sorted(avoid.items()):
            _check_nodes_left(jobs[num], nodes, by_partition)
    except slurm_query.SlurmQueryError as e:
        raise SweepError(f"cannot check that the retries find nodes enough once they avoid the ones "
                         f"that failed them: {e}; nothing was resubmitted") from e


def _check_nodes_left(job: Job, nodes: list[dict[str, Any]], by_partition: dict[str | None, list[str]]
                      ) -> None:
    params = job.resources["params"]
    partition = params.get("partition")  # None: the default partition
    known = by_partition.get(partition)
    if known is not None:  # a partition sinfo does not list is named by sbatch --test-only
        user = set(slurm_query.hostnames(params["exclude"])) if params.get("exclude") else set()
        names = sorted(n["node"] for n in nodes)
        left = [n for n in known if n not in user and n not in names]
        if len(left) < int(params.get("nodes", 1)):
            why = "; ".join(f"{n['node']}: {n['why']} (try {n['attempt']})" for n in nodes)
            raise SweepError(
                f"{job.ref}: its retry would avoid {', '.join(names)} ({why}), leaving {len(left)} of "
                f"the {len(known)} node(s) of partition {partition or '(default)'} for its "
                f"{params.get('nodes', 1)}: nothing was resubmitted. Bring the nodes back once fixed "
                f"(scontrol update nodename={names[0]} state=resume), or let retries land on any node "
                f"(cluster.max_excluded_nodes=0 in the point's config)")


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
    chunks = array_chunks(len(run_dirs), max_array_size(resources))
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
