"""Will SLURM ever start this request? Asked before anything is queued, and watched while it waits.

sbatch accepts requests no node can meet: three nodes from a two-node partition, 64 CPUs per task
on 2-CPU nodes. The job then stays PENDING (reason ``PartitionConfig``) forever while the client
waits without a word. So before submitting, the exact script submitit would queue is given to
``sbatch --test-only``: slurmctld schedules it on paper and queues nothing (a few milliseconds).
When it refuses, the partition's limits (``scontrol show partition``, ``sinfo``) say which value is
too large, and the error names that config key with a value that fits. The time limit is held to
the partition's ``MaxTime`` first, from the same ``scontrol show partition`` read once per check:
sbatch accepts a longer one unless the site sets ``EnforcePartLimits``, and the job then pends
(``PartitionTimeLimit``) forever.

What cannot be known at submission (a node drained later, a limit changed by an admin) is caught
while waiting: ``never_starts`` reads a pending job's reason from squeue, and the reasons in
``UNSATISFIABLE`` mean it cannot start as asked.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import SBATCH_OPTIONS, ConfigError, ParallelismConfig


def config_keys(parallelism: ParallelismConfig) -> dict[str, str]:
    """submitit parameter -> the config key that sets it for this config (``config.SBATCH_OPTIONS``),
    for an error that names the one to change."""
    return {o.param: o.key_for(parallelism) for o in SBATCH_OPTIONS if o.param is not None}


# The keys on CPU: what a refusal names when the config is not at hand.
CONFIG_KEYS = config_keys(ParallelismConfig())

# squeue reasons that mean "never, as asked" (SLURM's job_reason list): a partition, association or
# QOS limit the request exceeds, or names that are not valid.
UNSATISFIABLE = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
    "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSMaxNodePerJobLimit",
    "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob",
    "QOSMaxWallDurationPerJobLimit", "AssocMaxNodesPerJobLimit", "AssocMaxCpuPerJobLimit",
    "AssocMaxWallDurationPerJobLimit",
})

# Pending reasons no limit explains but that never clear by themselves either: a dependency that can
# no longer be met (afterok on a job that failed) and a hold that only scontrol release lifts. A
# job pending for one was waited for in silence, forever. Reason -> what it means.
NEVER_RELEASED = {
    "DependencyNeverSatisfied": "its dependency (cluster.dependency) can never be met: a job it waits "
                                "for ended in a state the dependency excludes",
    "JobHeldUser": "it is held (scontrol hold, or sbatch --hold) and starts only after scontrol release",
    "JobHeldAdmin": "an administrator held it, and it starts only after an administrator's scontrol "
                    "release",
}


def why_never(reason: str) -> str:
    """What a reason ``never_starts`` returned means, for the user."""
    return NEVER_RELEASED.get(reason, "its request exceeds a limit of its partition, account or QOS "
                                      "as they are now")


# sbatch's words for a refused value -> the submitit parameters that may hold it, and the fix.
# Options passed through cluster.sbatch_args and cluster.dependency sit in additional_parameters.
REFUSAL_HINTS = (
    ("invalid feature specification", ("constraint",),
     "no node of the partition has that feature (list them with sinfo -o '%N %f')"),
    ("invalid account", ("account",), "not an account of yours (sacctmgr show assoc user=$USER)"),
    ("invalid qos", ("qos",), "not a QOS you may use (sacctmgr show assoc user=$USER format=qos)"),
    ("parameter too long", ("job_name", "comment"), "shorten it"),
    ("reservation is invalid", ("reservation",), "no such reservation (scontrol show reservation)"),
    ("dependency", ("dependency",), "that job does not exist or can no longer satisfy it "
                                    "(sacct -j ID shows its state)"),
)


class SlurmRequestError(ConfigError):
    """SLURM would never start the job as configured; nothing was queued."""


@dataclass(frozen=True)
class PartitionLimits:
    name: str
    total_nodes: int
    max_nodes: int | None  # None: UNLIMITED
    max_time_min: int | None
    max_cpus_per_node: int  # of its largest node
    max_mem_mb: int
    max_gpus_per_node: int


def check(params: Mapping[str, Any], keys: Mapping[str, str] = CONFIG_KEYS) -> None:
    """Refuse (``SlurmRequestError``) a submitit SLURM request that sbatch --test-only refuses,
    naming the config keys that exceed the partition's limits and values that fit; first, one no
    controller would receive (``controller_down``)."""
    down = controller_down()
    if down is not None:
        raise SlurmRequestError(f"no SLURM controller answers, so nothing was queued: scontrol ping said: "
                                f"{down} (this machine's local cluster: switchyard cluster up; elsewhere "
                                f"check that slurmctld runs and that SLURM_CONF names it)")
    fields = partition_fields(params.get("partition"))  # None: not known here; sbatch says
    too_long = over_time(params, fields, keys) if fields is not None else None
    if too_long is not None:  # sbatch accepts it (EnforcePartLimits=NO), and the job pends forever
        raise SlurmRequestError(f"SLURM would never start this job, so nothing was queued: {too_long}")
    refusal = test_only(params)
    if refusal is None:
        return
    try:  # the partition as read above: scontrol is asked once
        reasons = [] if fields is None else over_limits(params, partition_limits(params.get("partition"),
                                                                                   fields), keys)
    except (OSError, subprocess.SubprocessError, ValueError, LookupError):
        reasons = []  # the limits are a courtesy; sbatch's own refusal is the verdict
    if "invalid partition" in refusal.lower():
        key, known = keys["partition"], partitions()
        reasons = [f"{key}={params.get('partition')!r} is invalid: no such partition (partitions: "
                   f"{', '.join(known)}) (try {key}={known[0] if known else 'null'})"]
    given = {**params, **params.get("additional_parameters", {})}
    for said, names, fix in REFUSAL_HINTS:
        held = [f"{_key_of(p, keys)}={given[p]!r}" for p in names if p in given]
        if said in refusal.lower() and held:
            reasons.append(f"{', '.join(held)}: {fix}")
    listed = "; ".join(reasons) if reasons else "no partition limit explains it"
    raise SlurmRequestError(f"SLURM would never start this job, so nothing was queued: {listed}. "
                            f"sbatch --test-only said: {refusal}")


def controller_down() -> str | None:
    """What ``scontrol ping`` says when no controller answers (the primary and every backup
    DOWN), else None. A tenth of a second either way, where sbatch --test-only retried for about
    a minute and sinfo and scontrol show for 30 s each before the refusal named no reason but
    "Unable to contact slurm controller". No scontrol: None (sbatch's own check says what is
    missing)."""
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    said = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("Slurmctld")]
    if proc.returncode == 0 or any(line.endswith(" is UP") for line in said):
        return None
    return "; ".join(said) or proc.stderr.strip() or f"exit code {proc.returncode}"


def test_only(params: Mapping[str, Any]) -> str | None:
    """sbatch's refusal of the script submitit would queue for ``params``, or None if accepted."""
    from submitit.slurm.slurm import _make_sbatch_string  # the one place submitit renders scripts

    with tempfile.TemporaryDirectory(prefix="switchyard-test-only-") as folder:
        script = Path(folder) / "job.sh"
        rendered = {k: v for k, v in params.items() if k != "python"}  # new_executor's, not sbatch's
        script.write_text(_make_sbatch_string(command="true", folder=folder, **rendered))
        try:
            proc = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True,
                                  text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise SlurmRequestError(f"cluster.mode='slurm' needs sbatch, which cannot run here ({e}): "
                                    f"submit from a SLURM login node (try cluster=local to run on "
                                    f"this machine)") from e
    if proc.returncode == 0:
        return None
    lines = [line.removeprefix("sbatch: error: ").strip() for line in proc.stderr.splitlines()]
    return "; ".join(line for line in lines if line) or f"exit code {proc.returncode}"


def partitions() -> list[str]:
    out = _run(["sinfo", "-h", "-o", "%R"])
    return sorted(set(out.split()))


def read_partition(name: str | None) -> dict[str, str]:
    """``scontrol show partition``'s fields of ``name`` (or of the default partition)."""
    for line in _run(["scontrol", "show", "partition", "-o", *([name] if name else [])]).splitlines():
        entry = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if name or entry.get("Default") == "YES":
            return entry
    raise LookupError(f"no partition {name or '(default)'}")


def partition_fields(name: str | None) -> dict[str, str] | None:
    """``read_partition``, or None when SLURM cannot say (no such partition, scontrol unreachable):
    then sbatch's own check is the verdict."""
    try:
        return read_partition(name)
    except (OSError, subprocess.SubprocessError, ValueError, LookupError):
        return None


def over_time(params: Mapping[str, Any], fields: Mapping[str, str],
              keys: Mapping[str, str] = CONFIG_KEYS) -> str | None:
    """'KEY=V but partition P allows at most M minutes (try KEY=M)' when the time limit asked for
    exceeds the partition's MaxTime; None when it fits or the partition has none."""
    time_min, name = params.get("time"), fields.get("PartitionName", "?")
    max_time_min = _limit(fields.get("MaxTime", "UNLIMITED"), _minutes)
    if time_min is None or max_time_min is None or int(time_min) <= max_time_min:
        return None
    return (f"{keys['time']}={time_min} but partition {name} allows at most {max_time_min} minutes "
            f"(MaxTime={fields['MaxTime']}) (try {keys['time']}={max_time_min})")


def partition_limits(name: str | None, fields: Mapping[str, str] | None = None) -> PartitionLimits:
    """The limits of ``name`` (or the default partition) and the size of its largest node;
    ``fields``: its ``scontrol show partition`` fields when already read."""
    fields = fields if fields is not None else read_partition(name)
    nodes = [line.split("|") for line in _run(["sinfo", "-h", "-N", "-p", fields["PartitionName"],
                                               "-o", "%N|%c|%m|%G"]).splitlines() if line]
    return PartitionLimits(
        name=fields["PartitionName"], total_nodes=int(fields["TotalNodes"]),
        max_nodes=_limit(fields.get("MaxNodes", "UNLIMITED"), int),
        max_time_min=_limit(fields.get("MaxTime", "UNLIMITED"), _minutes),
        max_cpus_per_node=max((int(n[1]) for n in nodes), default=0),
        max_mem_mb=max((int(n[2]) for n in nodes), default=0),
        max_gpus_per_node=max((_gpus(n[3]) for n in nodes), default=0))


def over_limits(params: Mapping[str, Any], limits: PartitionLimits,
                keys: Mapping[str, str] = CONFIG_KEYS) -> list[str]:
    """Each requested value that exceeds the partition, as 'KEY=V but ... (try KEY=FIT)'."""
    where = f"partition {limits.name}"
    found = []
    most_nodes = min(limits.total_nodes, limits.max_nodes or limits.total_nodes)
    if int(params.get("nodes", 1)) > most_nodes:
        found.append(f"{keys['nodes']}={params['nodes']} but {where} has {most_nodes} node(s) "
                     f"(try {keys['nodes']}={most_nodes})")
    tasks, cpus = int(params.get("ntasks_per_node", 1)), int(params.get("cpus_per_task", 1))
    if tasks * cpus > limits.max_cpus_per_node > 0:
        fit = limits.max_cpus_per_node // tasks
        change = f"{keys['cpus_per_task']}={fit}" if fit >= 1 else \
            f"{keys['ntasks_per_node']}={max(1, limits.max_cpus_per_node // cpus)}"
        found.append(f"{keys['ntasks_per_node']}={tasks} tasks per node x {keys['cpus_per_task']}="
                     f"{cpus} needs {tasks * cpus} CPUs but the largest node of {where} has "
                     f"{limits.max_cpus_per_node} (try {change})")
    gpus = int(params.get("gpus_per_node", 0) or 0)
    if gpus > limits.max_gpus_per_node:
        found.append(f"{keys['gpus_per_node']}={gpus} but the nodes of {where} have at most "
                     f"{limits.max_gpus_per_node} GPUs (try {keys['gpus_per_node']}="
                     f"{limits.max_gpus_per_node})")
    mem_mb = _megabytes(params.get("mem"))
    if mem_mb is not None and mem_mb > limits.max_mem_mb > 0:
        found.append(f"{keys['mem']}={mem_mb / 1024:g} but the largest node of {where} has "
                     f"{limits.max_mem_mb / 1024:.1f} GB (try {keys['mem']}="
                     f"{limits.max_mem_mb // 1024})")
    time_min = params.get("time")
    if time_min is not None and limits.max_time_min is not None and int(time_min) > limits.max_time_min:
        found.append(f"{keys['time']}={time_min} but {where} allows at most {limits.max_time_min} "
                     f"minutes (try {keys['time']}={limits.max_time_min})")
    return found


def never_starts(job_id: str, timeout_s: float = 30) -> str | None:
    """The squeue reason of a pending job that cannot start as asked; None if it may still start
    (or has started, or squeue cannot tell)."""
    reason = pending_reason(job_id, timeout_s)
    return reason if can_never_start(reason) else None


def can_never_start(reason: str | None) -> bool:
    """Whether a pending job's squeue reason is one it can never meet."""
    return reason in UNSATISFIABLE or reason in NEVER_RELEASED


def pending_reason(job_id: str, timeout_s: float = 30) -> str | None:
    """squeue's reason for a pending job (``Priority``, ``Resources``, ``Dependency``, ...); None
    when it is not pending, or squeue cannot tell."""
    try:
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        state, _, reason = line.partition("|")
        if state == "PENDING":
            return reason.strip()
    return None


def _key_of(param: str, keys: Mapping[str, str]) -> str:
    return keys.get(param) or f"cluster.sbatch_args --{param.replace('_', '-')}"


def _run(argv: list[str], timeout_s: float = 30) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True).stdout


def _limit(value: str, parse: Any) -> Any:
    return None if value in ("UNLIMITED", "NONE", "INFINITE") else parse(value)


def _minutes(value: str) -> int:
    """SLURM's time format ([D-]HH:MM:SS, MM:SS or minutes) -> whole minutes."""
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    hours, minutes, seconds = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + hours * 60 + minutes + (seconds > 0)


def _gpus(gres: str) -> int:
    """'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:8' -> the node's GPU count."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu:(?:[^:,()]+:)?(\d+)", gres))


def _megabytes(mem: Any) -> int | None:
    """submitit's mem parameter ('4096M', '4G') in MB."""
    if mem is None:
        return None
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", str(mem).upper())
    if not match:
        return None
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}[match.group(2)]
    return int(int(match.group(1)) * scale)
