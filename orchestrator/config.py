"""Every config schema, one dataclass per Hydra group, registered once in Hydra's ConfigStore.

YAML files under ``conf/`` hold values only; these dataclasses hold the types, the defaults and the
checks. ``__post_init__`` validates each group when ``OmegaConf.to_object`` builds it at the entry
point, so a bad value fails before any job is submitted, with a message that names the key, the value
and an override that fixes it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
import re
import struct
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value is invalid; the message names the key, the value and a fix."""


def invalid(key: str, value: object, why: str, fix: str) -> ConfigError:
    """One format for every config error: ``key=value is invalid: why (try fix)``."""
    return ConfigError(f"{key}={value!r} is invalid: {why} (try {fix})")


FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: torch turns larger numbers into inf
# The largest time limit SLURM stores as given (slurm 22.05, measured with sbatch --time=N and
# scontrol show job): it counts seconds in 32 bits, so 35,791,394 minutes and above came back as
# 2,957,761 days, 2,147,483,647 minutes as UNLIMITED and 99,999,999,999 as 2,981,813 days.
SLURM_MAX_TIME_MIN = (2**31 - 1) // 60 - 1
YEAR_S = 365 * 24 * 3600.0  # no wait or timeout of a job is longer (threading's own limit is ~292 years)


class Range(typing.NamedTuple):
    """The values a float field may take. Every float field has one, the default ``>= 0``: no
    float of a config means anything negative (a rate, a size, a timeout, a probability)."""

    low: float = 0.0
    high: float = math.inf  # besides: a float32 (check_floats)
    low_open: bool = False  # low itself is refused: > low
    high_open: bool = False  # high itself is refused: < high
    high_is: str = ""  # what the high bound is, in words ("a year")

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def text(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low:.15g}"
        if self.high == math.inf:
            return f"must be {low}"
        high = f"{'<' if self.high_open else '<='} {self.high:.15g}"
        return f"must be {low} and {high}{f', {self.high_is}' if self.high_is else ''}"


WITHIN_A_YEAR = Range(0, YEAR_S, low_open=True, high_is="a year")  # a duration in seconds


def ranged(default: float | None, values: Range) -> Any:
    """A float field with the range of values it means something for (``check_floats``)."""
    return field(default=default, metadata={"range": values})


def omegaconf_error(error: Exception) -> ConfigError:
    """OmegaConf's error about a value (an interpolation to no key, a string where a number goes),
    as ``key=value is invalid: why``; its own text spreads the key over several lines."""
    key, value = getattr(error, "full_key", None), getattr(error, "value", None)
    why = getattr(error, "msg", None)
    if not key or not why:
        return ConfigError(str(error))
    why = str(why).strip().splitlines()[0]
    shown = "" if value is None else f"={value!r}"
    return ConfigError(f"{key}{shown} is invalid: {why}")


def check_floats(group: Any, prefix: str) -> None:
    """Every float field of the dataclass ``group`` is finite, within its ``Range`` (declared
    with ``ranged``; else >= 0), and a float32 that neither overflows nor rounds to 0, which is
    what torch makes of it on the ranks: ``optim.lr=1e308`` was finite in Python and failed on
    every rank (``value cannot be converted to type float without overflow``). Checked before
    each group's own checks: NaN compares false with everything, so ``lr <= 0`` let
    ``optim.lr=nan`` through. Found from the annotations, so a new float field is covered without
    anyone remembering to add it here."""
    hints = typing.get_type_hints(type(group))
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        if not _is_float_field(hints[f.name]) or not isinstance(value, (int, float)):
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        key, fix = f"{prefix}{f.name}", f"{prefix}{f.name}={'null' if default is None else default}"
        values = f.metadata.get("range", Range())
        if not math.isfinite(value):
            raise invalid(key, value, "must be a finite number", fix)
        if not values.holds(value):
            raise invalid(key, value, values.text(), fix)
        if value > FLOAT32_MAX or (value != 0 and _as_float32(value) == 0):
            raise invalid(key, value, f"must be a float32, as torch holds it: at most "
                          f"{FLOAT32_MAX:.4g}, and 0 or at least 1.4e-45 (less rounds to 0)", fix)


def _as_float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


INT_MAX = 2**63 - 1  # the widest integer torch, NumPy and SQLite (the sweep registry) store


def check_ints(config: Any, prefix: str = "") -> None:
    """Every int of the dataclass ``config`` and of the groups inside it fits in 64 bits, checked
    before any other check compares it: ``seed=10**30`` passed ``seed >= 0`` and failed on every
    rank (torch cannot take it), ``data.batch_size=10**30`` was a traceback from torch."""
    for f in dataclasses.fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ints(value, f"{key}.")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_MAX:
            default = None if f.default is dataclasses.MISSING else f.default
            raise invalid(key, value, f"must fit in 64 bits (at most {INT_MAX})",
                          f"{key}={'null' if default is None else default}")


def _is_float_field(hint: Any) -> bool:
    return hint is float or float in typing.get_args(hint)


# ------------------------------------------------------------------------------------------------
# parallelism and cluster

MODES = ("debug", "local", "slurm")
RANK_STARTS = ("auto", "fork", "spawn")
BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("ddp", "fsdp")
REDUCE_DTYPES = ("fp32", "bf16")
# Values that end up on an #SBATCH line or an srun command line. SLURM names are words, dots,
# dashes and the node-list/feature syntax; anything else (a newline, `;`, `$(...)`, a quote) could
# smuggle a directive or a command into the generated script.
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.,:=+@%/\[\]-]*$")
_CONSTRAINT_SAFE = re.compile(r"^[A-Za-z0-9_.,:=+@%/\[\]&|*-]*$")  # feature expressions: a&b, [x*2|y]
_COMMENT_SAFE = re.compile(r"^[^\n\r\x00#`$\"'\\;]*$")


@dataclass
class ParallelismConfig:
    """How many ranks, where: ``nodes x gpus_per_node`` on GPU, ``nodes x procs_per_node`` on CPU."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU training, procs_per_node ranks per node
    procs_per_node: int = 2  # ranks per node when gpus_per_node == 0
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    # ddp: every rank holds the whole model, optimizer state and gradients (all-reduced).
    # fsdp: FSDP2 (fully_shard) shards parameters, gradients and optimizer state over the ranks.
    strategy: str = "ddp"
    # fsdp: the modules sharded (and all-gathered) one at a time, by class name; empty: the
    # model's own fsdp_units() (the built-in models shard each block), else the classes it names
    # in _no_split_modules (a Hugging Face model's blocks).
    fsdp_units: list[str] = field(default_factory=list)
    fsdp_reduce_dtype: str = "fp32"  # fsdp with memory.amp=bf16: dtype of the gradient reduce-scatter
    # fsdp: free each unit's gathered parameters after its forward (true: gathered again for its
    # backward) or keep them to its backward (false: a unit's full parameters held between the two,
    # one all-gather and one bf16 cast per unit per step saved: the choice for one GPU)
    fsdp_reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise invalid("parallelism.strategy", self.strategy, f"choose one of {STRATEGIES}",
                          "parallelism.strategy=fsdp")
        if self.fsdp_reduce_dtype not in REDUCE_DTYPES:
            raise invalid("parallelism.fsdp_reduce_dtype", self.fsdp_reduce_dtype,
                          f"choose one of {REDUCE_DTYPES}", "parallelism.fsdp_reduce_dtype=fp32")
        fsdp_only = {"fsdp_units": self.fsdp_units, "fsdp_reduce_dtype": self.fsdp_reduce_dtype != "fp32",
                     "fsdp_reshard_after_forward": not self.fsdp_reshard_after_forward}
        if self.strategy != "fsdp" and any(fsdp_only.values()):
            key = next(k for k, changed in fsdp_only.items() if changed)
            value = getattr(self, key)
            raise invalid(f"parallelism.{key}", value, f"it applies to parallelism.strategy=fsdp only, "
                          f"and parallelism.strategy={self.strategy!r}", "parallelism.strategy=fsdp, "
                          f"or drop parallelism.{key}")
        if self.nodes < 1:
            raise invalid("parallelism.nodes", self.nodes, "must be >= 1", "parallelism.nodes=1")
        if self.gpus_per_node < 0:
            raise invalid("parallelism.gpus_per_node", self.gpus_per_node, "must be >= 0",
                          "parallelism.gpus_per_node=0 for CPU")
        if self.gpus_per_node == 0 and self.procs_per_node < 1:
            raise invalid("parallelism.procs_per_node", self.procs_per_node, "must be >= 1 on CPU",
                          "parallelism.procs_per_node=2")
        if self.backend not in BACKENDS:
            raise invalid("parallelism.backend", self.backend, f"choose one of {BACKENDS}",
                          "parallelism.backend=auto")
        if self.backend == "nccl" and self.gpus_per_node == 0:
            raise invalid("parallelism.backend", self.backend, "nccl needs GPUs",
                          "parallelism.backend=gloo or parallelism.gpus_per_node=N")

    @property
    def tasks_per_node(self) -> int:
        """One task per GPU, or per process on CPU."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.procs_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


NEVER_STARTS = ("cancel", "keep")
DEFAULT_SIGNAL_DELAY_S = 120  # cluster.signal_delay_s, and what auto takes when nothing was measured


# Never copied into a snapshot (a Python package, a directory with __init__.py, is kept whatever its name).
SNAPSHOT_EXCLUDES: tuple[str, ...] = (".git", "__pycache__", "*.pyc", ".venv", "*.egg-info", "data",
                                     "checkpoints", "outputs", "multirun", ".pytest_cache", ".mypy_cache",
                                     ".ruff_cache")


@dataclass
class SnapshotConfig:
    """The code a SLURM job imports, copied when it is queued (``orchestrator/launch/snapshot.py``):
    a job that waits in the queue runs the code it was submitted with, not today's working tree."""

    enabled: bool = True  # false: the job imports whatever is in the working tree when it starts
    include: list[str] = field(default_factory=list)  # further directories or files to copy, by path
    exclude: list[str] = field(default_factory=lambda: list(SNAPSHOT_EXCLUDES))  # names (globs) never copied
    max_mb: float = ranged(100.0, Range(low_open=True))  # a larger one is refused, naming its largest files
    dir: str | None = None  # the store; null: ~/.cache/switchyard/snapshots (must be shared with the nodes)

    def __post_init__(self) -> None:
        check_floats(self, "cluster.snapshot.")


CONTAINER_RUNTIMES = ("none", "pyxis", "apptainer")
# A path, image URI or variable name on the srun line: no quotes, spaces or shell syntax.
# A '#' inside a word (pyxis's registry#image) is no shell comment.
_CONTAINER_SAFE = re.compile(r"^(?!#)[A-Za-z0-9_.,:=+@%/~#\[\]-]*$")


@dataclass
class ContainerConfig:
    """The image every rank runs in (``container=pyxis|apptainer``; ``orchestrator/launch/container.py``).
    The paths the job reads and writes are mounted without being listed here."""

    runtime: str = "none"  # none | pyxis (srun --container-image) | apptainer (apptainer exec)
    image: str | None = None  # pyxis: a registry URI or a .sqsh file; apptainer: a .sif or docker:// URI
    mounts: list[str] = field(default_factory=list)  # further mounts, SRC[:DST[:ro]], beside the derived ones
    workdir: str | None = None  # the ranks' working directory inside; null: the submitting directory
    env: list[str] = field(default_factory=list)  # names of variables the host's value overrides the image's
    writable: bool = False  # pyxis: a writable container root (--container-writable), else read-only
    mount_home: bool = False  # pyxis: mount $HOME too (--container-mount-home)
    nv: bool = True  # apptainer: --nv on GPU jobs (the node's NVIDIA driver inside)
    rocm: bool = False  # apptainer: --rocm instead, on AMD GPUs

    def __post_init__(self) -> None:
        if self.runtime not in CONTAINER_RUNTIMES:
            raise invalid("container", self.runtime, f"choose one of {CONTAINER_RUNTIMES}", "container=none")
        if self.runtime != "none" and not self.image:
            example = ("'\"nvcr.io#nvidia/pytorch:24.05-py3\"'" if self.runtime == "pyxis"
                       else "/images/torch.sif")
            raise invalid("cluster.container.image", self.image, f"container={self.runtime} runs the "
                          "ranks in an image, and none is named", f"cluster.container.image={example}")
        values = [("cluster.container.image", self.image), ("cluster.container.workdir", self.workdir),
                  *((f"cluster.container.mounts[{i}]", m) for i, m in enumerate(self.mounts)),
                  *((f"cluster.container.env[{i}]", e) for i, e in enumerate(self.env))]
        for key, value in values:
            if value is not None and not _CONTAINER_SAFE.match(value):
                raise invalid(key, value, "it goes onto the srun line of the generated sbatch script, "
                              "and quotes, spaces and shell metacharacters are refused there",
                              f"{key}=<a plain path or name>")
        for i, name in enumerate(self.env):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise invalid(f"cluster.container.env[{i}]", name, "a variable name, not NAME=VALUE "
                              "(its value is the submitting environment's)",
                              f"cluster.container.env=[{name.split('=')[0] or 'NAME'}]")


@dataclass
class ClusterConfig:
    """Where the job runs. ``debug``: in this process; ``local``: N processes here; ``slurm``."""

    mode: str = "local"  # debug | local | slurm
    job_name: str = "switchyard"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None  # nodes to avoid, SLURM node-list syntax
    comment: str | None = None
    timeout_min: int = 60  # SLURM time limit of each job, in minutes
    mem_gb: float | None = None  # per node; None: the partition's default
    gpu_mem_gb: float | None = ranged(None, Range(low_open=True))  # GiB of each GPU, for the memory
    # estimate; None: found or unknown
    cpus_per_task: int = 1
    # SIGUSR2 this long before the time limit: checkpoint and requeue. auto: from the slowest
    # checkpoint save the last run in the same run directory measured (orchestrator/launch/signal_delay.py)
    signal_delay_s: int | str = DEFAULT_SIGNAL_DELAY_S
    max_requeues: int = 3  # preemptions/timeouts survived before the job gives up
    # slurm: a failed job step (a killed rank, a NCCL or gloo error, a node gone) is started again
    # inside the same allocation, from the newest checkpoint, up to this many times, instead of
    # failing; the same failure twice in a row is the code's and ends the job
    # (orchestrator/launch/restarts.py)
    restarts: int = 0
    # A retry (switchyard resubmit) is kept off the nodes its failed attempts blamed (a node failure,
    # a rank killed by a signal, a CUDA/NCCL error), at most this many; 0: never
    max_excluded_nodes: int = 2
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (the one place for shell)
    srun_args: list[str] = field(default_factory=list)  # extra srun arguments, one per item
    wait: bool = True  # slurm: block until the job ends and report its result; false: print and return
    never_starts: str = "cancel"  # a waited-for job pending for a reason it can never meet: cancel | keep
    dry_run: bool = False  # slurm: print the sbatch script and the job's directory, queue nothing
    sbatch_args: list[str] = field(default_factory=list)  # further #SBATCH options: ["--mail-type=END"]
    dependency: str | None = None  # sbatch --dependency, e.g. afterok:1234 (prepare -> train -> eval)
    rendezvous_timeout_s: float = ranged(180.0, WITHIN_A_YEAR)  # ranks wait this long for rank 0
    # A collective that waits longer fails instead of hanging.
    collective_timeout_s: float = ranged(600.0, WITHIN_A_YEAR)
    # How the ranks start. fork: one process per node imports what every rank needs, then forks
    # them (orchestrator/launch/fork_start.py: a local job's controller; on SLURM, one srun task per
    # node, orchestrator/launch/node_launcher.py); spawn: each rank is a new interpreter that imports
    # it all again. auto: fork, except on SLURM with cluster.container or --gpus-per-task=1 in
    # cluster.srun_args, where srun starts each rank (see forks_ranks).
    rank_start: str = "auto"
    # ... except until the first step has ended: the ranks' imports, model build, compile warm-up
    # and checkpoint load differ by more than a step does. The larger of the two applies then.
    init_timeout_s: float = ranged(600.0, WITHIN_A_YEAR)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)  # slurm: the code the job runs
    container: ContainerConfig = field(default_factory=ContainerConfig)  # slurm: the image the ranks run in

    @property
    def forks_ranks(self) -> bool:
        """Whether one process per node imports once and forks the ranks (``rank_start`` resolved)."""
        if self.rank_start == "auto":
            return self._why_srun_starts_ranks() is None
        return self.rank_start == "fork"

    def _why_srun_starts_ranks(self) -> str | None:
        """Why each rank must be its own process here, or None where forking is built and tested."""
        if self.mode == "debug":
            return "with cluster=debug: the job runs in this process"
        if self.mode == "slurm" and self.container.runtime != "none":
            return (f"with cluster.container.runtime={self.container.runtime}: the node launcher has "
                    f"not been run inside a container yet, so srun starts each rank in the image")
        if self.mode == "slurm" and any(arg in SRUN_BINDINGS for arg in self.srun_args):
            return ("with --gpus-per-task=1 in cluster.srun_args: SLURM binds each task's own GPU, "
                    "and one task per node would get one GPU")
        return None

    def __post_init__(self) -> None:
        check_floats(self, "cluster.")
        if self.mode not in MODES:
            raise invalid("cluster.mode", self.mode, f"choose one of {MODES}", "cluster=local")
        if self.rank_start not in RANK_STARTS:
            raise invalid("cluster.rank_start", self.rank_start, f"choose one of {RANK_STARTS}",
                          "cluster.rank_start=auto")
        if self.rank_start == "fork" and (why := self._why_srun_starts_ranks()):
            raise invalid("cluster.rank_start", "fork", f"ranks cannot be forked {why}",
                          "cluster.rank_start=auto")
        for key in ("job_name", "partition", "account", "qos", "exclude"):
            _check_sbatch_value(f"cluster.{key}", getattr(self, key), _SBATCH_SAFE)
        if not self.job_name:  # sbatch --job-name= names the job after its script: every job "sbatch"
            raise invalid("cluster.job_name", self.job_name, "a job needs a name, which squeue, sacct "
                          "and --dependency=singleton show and match", "cluster.job_name=switchyard")
        _check_sbatch_value("cluster.constraint", self.constraint, _CONSTRAINT_SAFE)
        _check_sbatch_value("cluster.comment", self.comment, _COMMENT_SAFE)
        for i, arg in enumerate(self.srun_args):
            srun_option(f"cluster.srun_args[{i}]", arg)
        check_sbatch_args(self.sbatch_args)
        if self.dependency is not None and not _DEPENDENCY.match(self.dependency):
            raise invalid("cluster.dependency", self.dependency, "not an sbatch dependency: TYPE:JOBID"
                          "[:JOBID...] joined by ',' (all) or '?' (any), TYPE one of after, afterany, "
                          "afterok, afternotok, aftercorr; or singleton", "cluster.dependency=afterok:1234")
        if self.dry_run and self.mode != "slurm":
            raise invalid("cluster.dry_run", self.dry_run, "it prints the sbatch script of "
                          "cluster=slurm; other modes queue nothing", "cluster=slurm cluster.dry_run=true")
        if self.container.runtime != "none" and self.mode != "slurm":
            raise invalid("container", self.container.runtime, "a container runs the ranks of a SLURM "
                          "job; local and debug ranks run this machine's Python", "cluster=slurm")
        if self.never_starts not in NEVER_STARTS:
            raise invalid("cluster.never_starts", self.never_starts, f"choose one of {NEVER_STARTS}",
                          "cluster.never_starts=cancel")
        if self.mem_gb is not None and int(self.mem_gb * 1024) < 1:  # sbatch reads --mem=0 as "all of it"
            raise invalid("cluster.mem_gb", self.mem_gb, "must be at least 1 MiB (0.001); sbatch would "
                          "read the 0M it rounds to as the whole node's memory", "cluster.mem_gb=null")
        for key in ("timeout_min", "cpus_per_task"):
            if getattr(self, key) < 1:
                raise invalid(f"cluster.{key}", getattr(self, key), "must be >= 1", f"cluster.{key}=1")
        if self.timeout_min > SLURM_MAX_TIME_MIN:
            raise invalid("cluster.timeout_min", self.timeout_min, f"SLURM keeps a time limit of at most "
                          f"{SLURM_MAX_TIME_MIN} minutes (68 years, in seconds of 32 bits): a larger one "
                          f"wraps around to another limit, or to none", "cluster.timeout_min=1440, or at "
                          "most the partition's MaxTime: scontrol show partition")
        self._check_signal_delay()
        if self.max_requeues < 0:
            raise invalid("cluster.max_requeues", self.max_requeues, "must be >= 0",
                          "cluster.max_requeues=3")
        if self.restarts < 0:
            raise invalid("cluster.restarts", self.restarts, "must be >= 0", "cluster.restarts=0")
        if self.restarts and self.mode != "slurm":
            raise invalid("cluster.restarts", self.restarts, "restarts inside an allocation are SLURM's "
                          f"(cluster.mode={self.mode!r} has none: a local job is started again by "
                          f"running it again)", "cluster.restarts=0")
        if self.max_excluded_nodes < 0:
            raise invalid("cluster.max_excluded_nodes", self.max_excluded_nodes, "must be >= 0 (0: a "
                          "retry may land on any node)", "cluster.max_excluded_nodes=2")

    def _check_signal_delay(self) -> None:
        """A number of seconds below the time limit, or ``auto`` (a number once submitted)."""
        if isinstance(self.signal_delay_s, str):
            if self.signal_delay_s != "auto":
                raise invalid("cluster.signal_delay_s", self.signal_delay_s, "a number of seconds, or "
                              "auto (from the saves the last run in the run directory measured)",
                              "cluster.signal_delay_s=auto, or cluster.signal_delay_s=120")
            return
        limit_s = self.timeout_min * 60
        if self.signal_delay_s < 0 or self.signal_delay_s >= limit_s:
            fits = -(-self.signal_delay_s // 60) + 1  # a time limit this lead time fits under
            longer = (f", or cluster.timeout_min={fits}"
                      if self.signal_delay_s > 0 and fits <= SLURM_MAX_TIME_MIN else "")
            raise invalid("cluster.signal_delay_s", self.signal_delay_s,
                          f"must be between 0 and the time limit ({limit_s} s)",
                          f"cluster.signal_delay_s={signal_delay_within(limit_s)}{longer}")


def signal_delay_within(limit_s: int) -> int:
    """A lead time to propose under a time limit of ``limit_s``: the default, or half the limit
    when the default does not fit below it."""
    return min(DEFAULT_SIGNAL_DELAY_S, limit_s // 2)


_JOB_REF = r"\d+(?:_\d+)?(?:\+\d+)?"  # 1234, an array task 1234_7, and a +time delay
_DEPENDENCY = re.compile(rf"^(?:singleton|(?:after|afterany|afterok|afternotok|aftercorr)"
                         rf"(?::{_JOB_REF})+)(?:[,?](?:singleton|(?:after|afterany|afterok|afternotok|"
                         rf"aftercorr)(?::{_JOB_REF})+))*$")


@dataclass(frozen=True)
class SbatchOption:
    """One ``#SBATCH`` option Switchyard writes itself, and the config key that sets it.

    The one home of this mapping: ``launch.submit.slurm_parameters`` writes the options with a
    ``param`` from the config, ``cluster.sbatch_args`` refuses every option here (``MANAGED_SBATCH``),
    and ``launch.slurm_request`` names ``key`` in a refusal (``config_keys``).
    """

    option: str  # sbatch's long name: #SBATCH --cpus-per-task=4
    key: str  # the config key that sets it; for an option no single key sets, what does
    param: str | None = None  # the submitit SlurmExecutor parameter that writes it; None: written otherwise
    convert: Callable[[Any], Any] | None = None  # the key's value -> the parameter's (None: left out)
    gpu_key: str | None = None  # the key that sets it instead when parallelism.gpus_per_node > 0
    extra: bool = False  # submitit has no parameter for it: it goes in additional_parameters

    def key_for(self, parallelism: ParallelismConfig) -> str:
        return self.gpu_key if self.gpu_key and parallelism.gpus_per_node > 0 else self.key

    def value(self, cluster: ClusterConfig, parallelism: ParallelismConfig) -> Any:
        """The submitit parameter's value for this config; None: the option is left out."""
        group, _, name = self.key_for(parallelism).partition(".")
        value = getattr({"cluster": cluster, "parallelism": parallelism}[group], name)
        return value if self.convert is None or value is None else self.convert(value)

    @property
    def set_by(self) -> str:
        return f"{self.key} or {self.gpu_key}" if self.gpu_key else self.key


def _megabytes(mem_gb: float) -> str:
    return f"{int(mem_gb * 1024)}M"


_BY_THE_JOB = "the job itself"
_BY_RUN_DIR = "the job's directory (hydra.run.dir)"
# In sbatch's prefix order: `--n` is taken as --nodes, the first option it abbreviates (_managed).
SBATCH_OPTIONS: tuple[SbatchOption, ...] = (
    SbatchOption("nodes", "parallelism.nodes", "nodes"),
    SbatchOption("ntasks-per-node", "parallelism.procs_per_node", "ntasks_per_node",
                 gpu_key="parallelism.gpus_per_node"),
    SbatchOption("ntasks", "parallelism.*"),
    SbatchOption("gpus-per-node", "parallelism.gpus_per_node", "gpus_per_node",
                 convert=lambda gpus: gpus or None),  # 0: a CPU job asks for no GPU
    SbatchOption("gpus", "parallelism.*"),
    SbatchOption("cpus-per-task", "cluster.cpus_per_task", "cpus_per_task"),
    SbatchOption("time", "cluster.timeout_min", "time"),
    SbatchOption("mem", "cluster.mem_gb", "mem", convert=_megabytes),
    SbatchOption("partition", "cluster.partition", "partition"),
    SbatchOption("account", "cluster.account", "account"),
    SbatchOption("qos", "cluster.qos", "qos"),
    SbatchOption("constraint", "cluster.constraint", "constraint"),
    SbatchOption("exclude", "cluster.exclude", "exclude"),
    SbatchOption("comment", "cluster.comment", "comment"),
    SbatchOption("job-name", "cluster.job_name", "job_name"),
    SbatchOption("signal", "cluster.signal_delay_s", "signal_delay_s"),  # submitit writes USR2@N
    SbatchOption("dependency", "cluster.dependency", "dependency", extra=True),
    SbatchOption("output", _BY_RUN_DIR),
    SbatchOption("error", _BY_RUN_DIR),
    SbatchOption("array", "a sweep (-m)"),
    SbatchOption("wrap", _BY_THE_JOB),
    SbatchOption("open-mode", "submitit (it appends)"),
    SbatchOption("requeue", "cluster.max_requeues"),
    SbatchOption("no-requeue", "cluster.max_requeues"),
    SbatchOption("chdir", _BY_THE_JOB),
    SbatchOption("export", "cluster.setup (export lines run before srun)"),
)
# sbatch options Switchyard writes itself: set through these keys, never twice in one script.
MANAGED_SBATCH = {o.option: o.set_by for o in SBATCH_OPTIONS}
# sbatch options that change sbatch's own behaviour rather than the job's: (what went wrong, fix).
SBATCH_BEHAVIOUR = {
    "parsable": ("its answer is no longer 'Submitted batch job N', so a queued job was reported as "
                 "refused", "drop it; Switchyard prints the job id"),
    "wait": ("sbatch blocks until the job ends, whatever cluster.wait says", "cluster.wait=true"),
    "hold": ("the job is queued held and would never start on its own", "drop it; queue it later, "
             "or cluster.dependency=afterok:JOBID to start after another job"),
    "test-only": ("nothing is queued, and Switchyard already runs sbatch --test-only before "
                  "submitting", "cluster.dry_run=true to see the script"),
    "quiet": ("sbatch no longer prints the job id Switchyard reads", "drop it"),
    "clusters": ("the job lands on another cluster, where squeue, sacct and scancel do not look",
                 "run Switchyard on that cluster's login node"),
    "help": ("sbatch prints its help and queues nothing", "drop it"),
    "usage": ("sbatch prints its usage and queues nothing", "drop it"),
    "version": ("sbatch prints its version and queues nothing", "drop it"),
}
_SBATCH_OPTION = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(.+))?$")
# srun options that set the job step's shape (how many ranks, on which nodes, with what) or where
# its output goes: parallelism.* and cluster.* decide them, and every rank trusts that world.
# srun_args=["--ntasks=1"] started one rank of a world of 4 (issue 27).
_BY_PARALLELISM = "parallelism.nodes, procs_per_node and gpus_per_node"
MANAGED_SRUN = {
    "ntasks": _BY_PARALLELISM, "nodes": _BY_PARALLELISM, "ntasks-per-node": _BY_PARALLELISM,
    "ntasks-per-socket": _BY_PARALLELISM, "ntasks-per-core": _BY_PARALLELISM,
    "ntasks-per-gpu": _BY_PARALLELISM, "ntasks-per-tres": _BY_PARALLELISM,
    "gpus": _BY_PARALLELISM, "gpus-per-node": _BY_PARALLELISM, "gpus-per-socket": _BY_PARALLELISM,
    "gpus-per-task": _BY_PARALLELISM, "gres": _BY_PARALLELISM, "cpus-per-gpu": "cluster.cpus_per_task",
    "cpus-per-task": "cluster.cpus_per_task", "mem": "cluster.mem_gb", "mem-per-cpu": "cluster.mem_gb",
    "mem-per-gpu": "cluster.mem_gb", "distribution": "the rank order (node rank x local rank)",
    "overcommit": _BY_PARALLELISM, "nodelist": "cluster.exclude or cluster.constraint",
    "nodefile": "cluster.exclude or cluster.constraint", "exclude": "cluster.exclude",
    "relative": _BY_PARALLELISM, "het-group": "one homogeneous step",
    "multi-prog": "the job itself", "kill-on-bad-exit": "its fail-fast rule (a failed rank stops the others)",
    "output": "the job's directory (its logs are read back)", "error": "the job's directory (its "
    "logs are read back)", "input": "the job itself", "chdir": "the job itself",
}
SRUN_SHORT = {"n": "ntasks", "N": "nodes", "c": "cpus-per-task", "m": "distribution", "O": "overcommit",
              "G": "gpus", "w": "nodelist", "x": "exclude", "r": "relative", "o": "output", "e": "error",
              "i": "input", "K": "kill-on-bad-exit", "D": "chdir"}
# Binds one of the GPUs each node already gives its tasks to each task: the same GPUs, no more
# (docs/gpus.md).
SRUN_BINDINGS = ("--gpus-per-task=1",)


def srun_option(key: str, arg: str) -> None:
    """One ``cluster.srun_args`` item; refused when it would change the job step's shape."""
    _check_sbatch_value(key, arg, _SBATCH_SAFE)
    if arg in SRUN_BINDINGS:
        return
    if arg.startswith("--"):
        name: str | None = arg[2:].partition("=")[0]
    else:  # -n4, -N 2: the letter after the dash
        name = SRUN_SHORT.get(arg[1:2]) if arg.startswith("-") else None
    managed = _managed(name, MANAGED_SRUN) if name else None
    if managed is not None:
        raise invalid(key, arg, f"Switchyard sets --{managed} on the job step itself, from "
                      f"{MANAGED_SRUN[managed]}", "that key instead, or drop the item")


def _managed(name: str, table: Mapping[str, object]) -> str | None:
    """The option of ``table`` that ``name`` means: srun and sbatch take any unambiguous
    abbreviation (``--ntasks-per-n`` is ``--ntasks-per-node``), so a prefix counts too."""
    if name in table:
        return name
    return next((option for option in table if option.startswith(name)), None)


def sbatch_option(key: str, arg: str) -> tuple[str, str | bool]:
    """One ``cluster.sbatch_args`` item -> (option, value or True); refused with the reason."""
    _check_sbatch_value(key, arg, _SBATCH_SAFE)
    match = _SBATCH_OPTION.match(arg)
    if match is None:
        raise invalid(key, arg, "write each option in its long form, --name=value or --name",
                      f"{key}=--mail-type=END")
    name, value = match.group(1), match.group(2)
    managed = _managed(name, MANAGED_SBATCH)
    if managed is not None:
        raise invalid(key, arg, f"Switchyard writes --{managed} itself, from {MANAGED_SBATCH[managed]}",
                      "that key instead")
    behaviour = _managed(name, SBATCH_BEHAVIOUR)
    if behaviour is not None:
        why, fix = SBATCH_BEHAVIOUR[behaviour]
        raise invalid(key, arg, f"--{behaviour} changes how sbatch itself behaves, and Switchyard runs "
                      f"sbatch and reads its answer: {why}", fix)
    return name, True if value is None else value


def check_sbatch_args(args: list[str]) -> None:
    """Each item of ``cluster.sbatch_args``, and no option twice: submitit keeps one value per
    option, so the other was dropped without a word."""
    seen: dict[str, int] = {}
    for i, arg in enumerate(args):
        name, _ = sbatch_option(f"cluster.sbatch_args[{i}]", arg)
        if name in seen:
            raise invalid(f"cluster.sbatch_args[{i}]", arg, f"--{name} is already given by "
                          f"cluster.sbatch_args[{seen[name]}]={args[seen[name]]!r}, and only one would "
                          f"reach the script", "one item per option")
        seen[name] = i


def _check_sbatch_value(key: str, value: str | None, allowed: re.Pattern[str]) -> None:
    if value is None:
        return
    if "\n" in value or "\r" in value or "#SBATCH" in value.upper() or not allowed.match(value):
        raise invalid(key, value, "it goes into the generated sbatch script, and newlines, '#SBATCH' "
                      "and shell metacharacters are refused there (put shell in cluster.setup, "
                      "the one place meant for it)", f"{key}=<a plain SLURM name>")


# ------------------------------------------------------------------------------------------------
# jobs.prepare


PREPARE_FORMATS = ("auto", "npy_dir", "pt", "megatron", "text", "image_folder", "hf")


@dataclass
class PrepareConfig:
    """``python -m jobs.prepare input=... output=...``: raw samples -> a sharded dataset."""

    input: str = MISSING  # .npy directory, .pt file, Megatron prefix, text corpus or image folder
    output: str = MISSING  # the dataset directory to create; must not exist unless overwrite=true
    # auto | npy_dir | pt | megatron | text | image_folder | hf (auto: detected from the input
    # path; a .txt or .jsonl file is text, a directory of class folders of images is image_folder,
    # a save_to_disk directory or a .parquet file is hf; a directory of text documents needs
    # format=text, a .jsonl read by columns format=hf)
    format: str = "auto"
    shard_bytes: int = 256 * 2**20  # a shard's data file is rolled over at this size; no 4 GiB cap
    field: str = "x"  # field name given to samples that are a bare array (npy, megatron, list of tensors)
    num_workers: int = 0  # reader processes; 0 picks min(4, cpu count) when the input allows it
    overwrite: bool = False  # replace an existing dataset at output (published atomically)
    # text: bytes (UTF-8 bytes, EOS 256) | bpe (trained on the input) | PATH of a tokenizer.json
    tokenizer: str = "bytes"
    tokenizer_vocab: int | None = None  # tokenizer=bpe: ids to train (>= 257); null: 16384
    eos_token: str | None = None  # tokenizer=PATH: its EOS token; null: the first usual one it has
    skip_bad: bool = False  # text: skip (and count) documents that are not UTF-8, instead of refusing
    labels: str | None = None  # npy_dir: a .npy of one label per file (sorted order), stored as y
    # hf (a save_to_disk directory, .parquet, or .jsonl with format=hf): the column tokenized as
    # text; or the columns stored as fields of the same names, and the one stored as labels y
    text_field: str | None = None
    fields: list[str] = dataclasses.field(default_factory=list)
    label_field: str | None = None
    split: str | None = None  # hf: the split of a saved DatasetDict (needed when it has several)

    def __post_init__(self) -> None:
        check_ints(self)
        if self.format not in PREPARE_FORMATS:
            raise invalid("format", self.format, f"choose one of {PREPARE_FORMATS}", "format=auto")
        if self.shard_bytes < 8:
            raise invalid("shard_bytes", self.shard_bytes, "must be >= 8",
                          f"shard_bytes={256 * 2**20}")
        if not self.field:
            raise invalid("field", self.field, "must be a non-empty name", "field=x")
        if self.num_workers < 0:
            raise invalid("num_workers", self.num_workers, "must be >= 0 (0 picks for you)",
                          "num_workers=0")
        for key in ("input", "output"):
            if getattr(self, key) == "":
                raise invalid(key, "", "must be a path", f"{key}=/path/to/data")
        self._check_tokenizer_keys()

    def _check_tokenizer_keys(self) -> None:
        """A tokenizer key that the chosen tokenizer would not read is refused, not ignored."""
        if not self.tokenizer:
            raise invalid("tokenizer", "", "must be bytes, bpe or the path of a tokenizer.json",
                          "tokenizer=bytes")
        if self.tokenizer_vocab is not None and self.tokenizer != "bpe":
            raise invalid("tokenizer_vocab", self.tokenizer_vocab,
                          f"is only read by tokenizer=bpe (tokenizer={self.tokenizer})",
                          "tokenizer=bpe, or drop tokenizer_vocab")
        if self.tokenizer_vocab is not None and self.tokenizer_vocab < 257:
            raise invalid("tokenizer_vocab", self.tokenizer_vocab,
                          "must be >= 257 (the 256 bytes and EOS)", "tokenizer_vocab=16384")
        if self.eos_token is not None and self.tokenizer in ("bytes", "bpe"):
            raise invalid("eos_token", self.eos_token,
                          f"is only read with a tokenizer.json path (tokenizer={self.tokenizer} "
                          f"has its own EOS)", "drop eos_token")


# ------------------------------------------------------------------------------------------------
# jobs.train: model, data, optim, memory, checkpoint

AMP_MODES = ("none", "bf16", "fp16")
ESTIMATE_MODES = ("check", "warn", "off")
OPTIMIZERS = ("adamw", "sgd")
# optim.implementation: auto is fused on CUDA (where torch has the kernel), foreach elsewhere
OPTIM_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("blocks", "model")
SCHEDULES = ("constant", "cosine", "linear")
ON_NONFINITE = ("stop", "skip")
POLICIES = ("pad", "drop")


@dataclass
class ModelCompileConfig:
    """``model.compile*``: torch.compile per block (training/compiling.py). Every built-in model
    schema holds these keys; ``model=custom`` and a user's own model config take them too
    (``model.compile=true``: ``any_model_compile``). They are never passed to the model's
    constructor."""

    compile: bool = False  # torch.compile each fsdp unit (block), else the whole model, in place
    compile_scope: str = "blocks"  # blocks: each fsdp unit (block) | model: the whole model, as nanoGPT
    # ddp: dynamo's DDP optimizer splits each compiled graph where DDP's gradient buckets end, so
    # an all-reduce can start while the rest of backward runs (false: one graph, more fusion)
    compile_optimize_ddp: bool = True
    compile_fullgraph: bool = True  # a graph break inside a block is an error, not a silent split
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (the last two: for debugging)
    compile_dynamic: bool | None = None  # None: a dim is made dynamic once it changed; true/false: forced
    # Recompiles of one block past this fail the run naming the guard that failed (torch's own
    # limit is 8; each recompile is logged with its reason). A train and an eval graph are 2.
    compile_recompile_limit: int = 8

    def __post_init__(self) -> None:
        check_compile(self)


def any_model_compile(overrides: Sequence[str]) -> list[str]:
    """``model.compile*=V`` as ``++model.compile*=V`` (Hydra's "set, or add if absent"): every
    model takes these keys, but only the built-ins' schemas declare them, and Hydra refused
    ``model.compile=true`` under ``model=custom`` or a user's own model config ("Key 'compile' is
    not in struct"), where only ``+model.compile=true`` worked. Other overrides as given."""
    keys = {f"model.{f.name}" for f in dataclasses.fields(ModelCompileConfig)}
    return [f"++{o}" if o.partition("=")[0] in keys else o for o in overrides]


def check_compile(spec: Any) -> None:
    """``model.compile*`` of a schema or of ``model=custom``'s mapping."""
    get = spec.get if isinstance(spec, dict) else lambda key, default: getattr(spec, key, default)
    mode, limit = get("compile_mode", "default"), get("compile_recompile_limit", 8)
    if mode not in COMPILE_MODES:
        raise invalid("model.compile_mode", mode, f"choose one of {COMPILE_MODES}",
                      "model.compile_mode=default")
    scope = get("compile_scope", "blocks")
    if scope not in COMPILE_SCOPES:
        raise invalid("model.compile_scope", scope, f"choose one of {COMPILE_SCOPES}",
                      "model.compile_scope=blocks")
    if not isinstance(limit, int) or limit < 1:
        raise invalid("model.compile_recompile_limit", limit, "must be >= 1",
                      "model.compile_recompile_limit=8")


def check_sizes(spec: Any, widths: tuple[str, ...]) -> None:
    """A built-in model's sizes: each width >= 1 (``model.hidden_dim=0`` built a zero-width model
    that trained to exit 0, its output the head's bias alone), ``num_layers`` >= 0 (0: no blocks,
    the embedding and the head)."""
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    for key in widths:
        if getattr(spec, key) < 1:
            raise invalid(f"model.{key}", getattr(spec, key), "a model's widths and head counts must be >= 1",
                          f"model.{key}={defaults[key]}")
    if spec.num_layers < 0:
        raise invalid("model.num_layers", spec.num_layers, "must be >= 0 (0: no blocks)",
                      f"model.num_layers={defaults['num_layers']}")


@dataclass
class MlpConfig(ModelCompileConfig):
    """Row-pooling MLP: embeds each row, masked mean over rows, then an MLP head."""

    _target_: str = "jobs.models.RowPoolingMLP"
    hidden_dim: int = 64
    num_layers: int = 2

    def __post_init__(self) -> None:
        check_compile(self)
        check_sizes(self, ("hidden_dim",))


@dataclass
class GptConfig(ModelCompileConfig):
    """A decoder-only transformer for task=causal_lm: causal attention, tied embeddings."""

    _target_: str = "jobs.models.GPT"
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    ff_mult: int = 4  # feed-forward width = ff_mult x d_model
    dropout: float = ranged(0.0, Range(0, 1))  # a probability: torch refuses more only on the ranks

    def __post_init__(self) -> None:
        check_floats(self, "model.")
        check_compile(self)
        check_sizes(self, ("d_model", "num_heads", "ff_mult"))


@dataclass
class ClassifyTaskConfig:
    """task=classify: an integer class per sample (data.target_field), cross-entropy, accuracy."""

    _target_: str = "orchestrator.training.tasks.classify.Classify"


@dataclass
class RegressTaskConfig:
    """task=regress: a float target of any fixed shape, MSE; MSE and MAE in evaluation."""

    _target_: str = "orchestrator.training.tasks.regress.Regress"


@dataclass
class CausalLmTaskConfig:
    """task=causal_lm: next-token loss over windows of data.seq_len + 1 packed tokens."""

    _target_: str = "orchestrator.training.tasks.causal_lm.CausalLm"
    field: str = "tokens"  # the 1-D token field (one document per sample)
    vocab_size: int | None = None  # null: the dataset's recorded tokenizer


@dataclass
class TransformerConfig(ModelCompileConfig):
    """A small transformer encoder over the rows of a sample, masked mean-pooled."""

    _target_: str = "jobs.models.RowTransformer"
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    ff_dim: int = 128
    dropout: float = ranged(0.0, Range(0, 1))  # a probability: torch refuses more only on the ranks

    def __post_init__(self) -> None:
        check_floats(self, "model.")
        check_compile(self)
        check_sizes(self, ("d_model", "num_heads", "ff_dim"))


@dataclass
class DataConfig:
    """What each rank reads. ``path: null`` generates a small demo dataset once, into cache_dir."""

    path: str | None = None  # training dataset directory (made by jobs.prepare or DatasetWriter)
    eval_path: str | None = None  # evaluation dataset; null with path set: no evaluation
    cache_dir: str = "~/.cache/switchyard/datasets"  # where the demo dataset is generated once
    input_field: str = "x"  # the model's input (classify, regress): [rows, features], an image, ...
    target_field: str = "y"  # classify: an integer class; regress: a float value or array
    num_classes: int | None = None  # classify: classes of target_field; null: the dataset's record
    seq_len: int = 256  # causal_lm: tokens per window (each window reads seq_len + 1)
    batch_size: int = 32  # per rank, per micro-step
    num_workers: int = 0  # DataLoader workers per rank
    policy: str = "pad"  # pad: every sample once, padding flagged; drop: never repeat
    group_by_length: bool = False  # batch similar row counts together to cut padding
    demo_num_samples: int = 4096  # demo dataset size (train; eval is a quarter of it)
    demo_features: int = 16
    demo_classes: int = 4
    demo_max_rows: int = 48

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise invalid("data.policy", self.policy, f"choose one of {POLICIES}", "data.policy=pad")
        for key in ("batch_size", "seq_len", "demo_num_samples", "demo_features", "demo_classes",
                    "demo_max_rows"):
            if getattr(self, key) < 1:
                raise invalid(f"data.{key}", getattr(self, key), "must be >= 1", f"data.{key}=32")
        if self.num_workers < 0:
            raise invalid("data.num_workers", self.num_workers, "must be >= 0", "data.num_workers=0")
        if self.num_classes is not None and self.num_classes < 2:
            raise invalid("data.num_classes", self.num_classes, "must be >= 2", "data.num_classes=2")
        if not self.cache_dir.strip():  # Path("") is the working directory
            raise invalid("data.cache_dir", self.cache_dir, "an empty path is the working directory, where "
                          "the demo dataset would be written among your files",
                          "data.cache_dir=~/.cache/switchyard/datasets, the default, or another directory")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            try:
                found = value is None or (Path(value).expanduser() / "manifest.json").is_file()
            except OSError:  # a name too long for the file system (is_file raises, not False)
                found = False
            if not found:
                raise invalid(f"data.{key}", value, "no dataset there (no manifest.json)",
                              f"data.{key}=<a directory made by python -m jobs.prepare> or "
                              f"data.{key}=null for the demo dataset")


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = ranged(3e-3, Range(0, 10, low_open=True))  # more than 10 diverges at once
    weight_decay: float = ranged(0.0, Range(0, 1))  # decoupled (adamw): each step scales by 1 - lr x this
    momentum: float = ranged(0.9, Range(0, 1, high_open=True))  # sgd only; 1 or more never decays
    schedule: str = "constant"  # constant | cosine | linear (decay to 0 at max_steps)
    warmup_steps: int = 0
    grad_accum_steps: int = 1  # micro-batches per optimizer step; DDP syncs only on the last
    clip_grad_norm: float = 0.0  # 0: no clipping
    max_steps: int = 200  # optimizer steps
    # A step whose loss is NaN or infinite on any rank. stop: the run fails naming the step, and no
    # checkpoint of the weights it made is written (checked at log steps and before each checkpoint,
    # with no host read on other steps). skip: that step's update is skipped on every rank (one
    # host read per step), and the run fails once log_every_steps steps in a row were skipped.
    on_nonfinite: str = "stop"
    # The optimizer's kernels: fused (one kernel for all parameters), foreach (a few per parameter
    # group) or for-loop (one parameter at a time). auto: fused on CUDA, foreach elsewhere. The same
    # maths, so a checkpoint resumes under any of them.
    implementation: str = "auto"

    def __post_init__(self) -> None:
        check_floats(self, "optim.")
        if self.implementation not in OPTIM_IMPLEMENTATIONS:
            raise invalid("optim.implementation", self.implementation,
                          f"choose one of {OPTIM_IMPLEMENTATIONS}", "optim.implementation=auto")
        if self.name not in OPTIMIZERS:
            raise invalid("optim.name", self.name, f"choose one of {OPTIMIZERS}", "optim.name=adamw")
        if self.schedule not in SCHEDULES:
            raise invalid("optim.schedule", self.schedule, f"choose one of {SCHEDULES}",
                          "optim.schedule=constant")
        if self.on_nonfinite not in ON_NONFINITE:
            raise invalid("optim.on_nonfinite", self.on_nonfinite, f"choose one of {ON_NONFINITE}",
                          "optim.on_nonfinite=stop")
        for key in ("grad_accum_steps", "max_steps"):
            if getattr(self, key) < 1:
                raise invalid(f"optim.{key}", getattr(self, key), "must be >= 1", f"optim.{key}=1")
        if self.warmup_steps < 0:  # lr, clip_grad_norm, weight_decay, momentum: check_floats
            raise invalid("optim.warmup_steps", self.warmup_steps, "must be >= 0", "optim.warmup_steps=0")


@dataclass
class MemoryConfig:
    """The memory levers that turn an OOM into a run: precision, recomputation, accumulation."""

    amp: str = "none"  # none | bf16 (autocast) | fp16 (autocast + grad scaler)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # fp32 matmuls and convolutions on TF32 tensor cores (A100 and later: ~8x FP32's throughput,
    # a 10-bit mantissa per product, fp32 accumulation). false: full FP32. GPU ranks only.
    tf32: bool = True
    # The peak memory per rank, estimated before submission (training/estimate.py). check: a step
    # above 95% of the GPU is refused, naming the cheapest option that fits; warn: shown only; off.
    estimate: str = "check"
    # Estimates remembered across submissions, by a hash of the step's config, data and code
    # (training/estimate_memo.py): the same step submitted again skips the fake-tensor run and its
    # imports (1.5-2.5 s of the submitting process). null: run the estimate at every submission.
    estimate_cache: str | None = "~/.cache/switchyard/memory-estimates"
    # A step that runs out of memory is run again at half the micro-batch (twice the pieces per
    # step: the same samples and gradient), on every rank; the size is kept for the rest of the run
    # and in the checkpoint (training/microbatch.py). ddp only.
    auto_microbatch: bool = False

    def __post_init__(self) -> None:
        if self.amp not in AMP_MODES:
            raise invalid("memory.amp", self.amp, f"choose one of {AMP_MODES}", "memory.amp=bf16")
        if self.estimate not in ESTIMATE_MODES:
            raise invalid("memory.estimate", self.estimate, f"choose one of {ESTIMATE_MODES}",
                          "memory.estimate=warn")


EXPORT_FORMATS = ("hf", "safetensors")  # switchyard export --format, checkpoint.export


@dataclass
class CheckpointConfig:
    dir: str | None = None  # null: RUN_DIR/checkpoints
    every_steps: int = 0  # 0: only at the end
    keep_last: int = 2
    # ddp: the loop waits only for a host copy of the state; the write runs in the background.
    # The save at a preemption or at the end is always blocking and complete before the exit.
    async_save: bool = True
    # A resume under other code than the checkpoint was written with is refused; true lets it go
    # on (an intended fix), and the change is recorded in summary.json.
    allow_code_change: bool = False
    # Start from another run's checkpoint: a step-N.pt / step-N.dcp, or a checkpoint directory (its
    # newest good one). Without it a run resumes only checkpoints it wrote itself; once it has its
    # own, a requeue continues from those (orchestrator/training/resume.py).
    resume_from: str | None = None
    # Export while training, off the step loop (orchestrator/training/exporting.py): hf (a
    # save_pretrained directory) or safetensors (model.safetensors + the composed config), each
    # into RUN/exports/step-N-FORMAT, reloaded and compared with its checkpoint in a subprocess.
    export: str | None = None
    export_every: int = 1  # every K-th checkpoint (steps that are multiples of every_steps x K), and the last
    # null: an export is pruned with its checkpoint (keep_last); N: the newest N exports are kept
    keep_exports: int | None = None
    export_shard_mb: int = 5000  # hf: a safetensors file holds at most this many MB (then an index)

    def __post_init__(self) -> None:
        if self.export not in (None, *EXPORT_FORMATS):
            raise invalid("checkpoint.export", self.export, f"must be null or one of {list(EXPORT_FORMATS)}",
                          "checkpoint.export=hf")
        if self.export_every < 1:
            raise invalid("checkpoint.export_every", self.export_every, "must be >= 1",
                          "checkpoint.export_every=1")
        if self.keep_exports is not None and self.keep_exports < 1:
            raise invalid("checkpoint.keep_exports", self.keep_exports,
                          "must be null (pruned with its checkpoint) or >= 1", "checkpoint.keep_exports=2")
        if self.export_shard_mb < 1:
            raise invalid("checkpoint.export_shard_mb", self.export_shard_mb, "must be >= 1",
                          "checkpoint.export_shard_mb=5000")
        if self.every_steps < 0:
            raise invalid("checkpoint.every_steps", self.every_steps, "must be >= 0",
                          "checkpoint.every_steps=100")
        if self.keep_last < 1:
            raise invalid("checkpoint.keep_last", self.keep_last, "must be >= 1", "checkpoint.keep_last=2")
        # `checkpoint.dir=` typed empty went on as if null, unsaid; it names no directory
        for key, value, default in (("dir", self.dir, "RUN_DIR/checkpoints"),
                                    ("resume_from", self.resume_from, "no checkpoint of another run")):
            if value is not None and not value.strip():
                raise invalid(f"checkpoint.{key}", value, f"an empty path names nothing (null: {default})",
                              f"checkpoint.{key}=null, or checkpoint.{key}=<a path>")


@dataclass
class TelemetryConfig:
    """Memory over time: per GPU through NVML, or per rank's RSS/USS without an NVIDIA driver."""

    enabled: bool = True
    # a sample: ~0.1 ms without NVML, ~9 ms through NVML on an H100 node
    interval_s: float = ranged(5.0, WITHIN_A_YEAR)
    # jobs.train's slow ranks (orchestrator/training/stragglers.py): a rank whose median lateness
    # into the gradient reduction is over this share of a step, in slow_rank_windows logging windows
    # in a row, is flagged (its node is left out by resubmit --failed); 0: not measured
    slow_rank_fraction: float = ranged(0.25, Range(0, 100))
    slow_rank_windows: int = 3

    def __post_init__(self) -> None:
        check_floats(self, "telemetry.")
        if self.slow_rank_windows < 1:
            raise ConfigError(f"telemetry.slow_rank_windows={self.slow_rank_windows} is invalid: a rank is "
                              f"flagged after this many logging windows in a row, at least 1 (try "
                              f"telemetry.slow_rank_windows=3, or telemetry.slow_rank_fraction=0 to stop "
                              f"measuring)")


@dataclass
class LoggerConfig:
    """Where rank 0 writes the metrics reduced over all ranks: RUN/metrics.jsonl always, plus these."""

    tensorboard: bool = True  # event files in RUN/tensorboard: tensorboard --logdir <run or sweep dir>
    wandb: bool = False  # Weights & Biases (pip install 'switchyard[wandb]'); WANDB_MODE=offline works
    wandb_project: str = "switchyard"
    wandb_entity: str | None = None  # your W&B team or user; None: W&B's default


@dataclass
class TrainConfig:
    """``python -m jobs.train``: the groups composed into one run."""

    model: Any = MISSING  # a model schema above, or any dict with a _target_ (model=custom)
    task: Any = MISSING  # a task schema above, or any dict with a _target_ (task=custom)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    eval_every_steps: int = 0  # 0: evaluate once, at the end
    log_every_steps: int = 10
    deterministic: bool = False  # torch.use_deterministic_algorithms: bit-exact reruns on CPU
    # >0: a torch.profiler trace of this many steps after the first log window, with their time
    # by kernel class, into RUN/profile/ (training/profiling.py)
    profile_steps: int = 0

    def __post_init__(self) -> None:
        if self.task == MISSING:  # built in Python without one (Hydra's defaults list always sets it)
            self.task = ClassifyTaskConfig()
        check_ints(self)
        if self.log_every_steps < 1:
            raise invalid("log_every_steps", self.log_every_steps, "must be >= 1", "log_every_steps=10")
        if self.eval_every_steps < 0:
            raise invalid("eval_every_steps", self.eval_every_steps, "must be >= 0 (0: at the end)",
                          "eval_every_steps=0")
        if self.seed < 0:
            raise invalid("seed", self.seed, "must be >= 0 (the sampler's shuffle takes it)", "seed=0")
        if self.profile_steps < 0:
            raise invalid("profile_steps", self.profile_steps, "must be >= 0 (0: no profile)",
                          "profile_steps=5")
        model = group_dict(self.model) if self.model != MISSING else {}
        whole = model.get("compile") and model.get("compile_scope") == "model"
        if self.parallelism.strategy == "fsdp" and whole:
            raise invalid("model.compile_scope", "model", "parallelism.strategy=fsdp all-gathers each block "
                          "in hooks a whole-model graph cannot hold (compile each block instead)",
                          "model.compile_scope=blocks, or parallelism.strategy=ddp")
        parallelism = self.parallelism
        if self.cluster.mode == "local" and parallelism.gpus_per_node and parallelism.nodes > 1:
            raise invalid("parallelism.nodes", parallelism.nodes, "GPUs in cluster=local run on this "
                          "machine, one rank per GPU", f"parallelism.nodes=1 parallelism.gpus_per_node="
                          f"{parallelism.nodes * parallelism.gpus_per_node}")
        if parallelism.strategy == "fsdp" and self.memory.amp == "fp16":
            raise invalid("memory.amp", self.memory.amp, "parallelism.strategy=fsdp takes bf16 mixed "
                          "precision (FSDP2's policy: bf16 parameters, fp32 gradient reduction); fp16 "
                          "needs a gradient scaler that does not work on sharded gradients",
                          "memory.amp=bf16, or parallelism.strategy=ddp")
        if parallelism.strategy == "fsdp" and self.memory.auto_microbatch:
            raise invalid("memory.auto_microbatch", True, "parallelism.strategy=fsdp all-gathers "
                          "parameters inside forward and backward, so one rank running out of memory "
                          "there would leave the others waiting in a collective",
                          "memory.auto_microbatch=false, or parallelism.strategy=ddp")
        if self.memory.auto_microbatch and self.model != MISSING and group_dict(self.model).get("compile"):
            raise invalid("memory.auto_microbatch", True, "model.compile=true is not tested with it: "
                          "each halving is a new shape to compile, and a compiled graph that ran "
                          "out of memory is not known to be safe to run again",
                          "memory.auto_microbatch=false, or model.compile=false")
        if self.cluster.mode == "debug" and self.parallelism.world_size > 1:
            # Not an error: debug mode exists to step through one rank.
            gpus = min(self.parallelism.gpus_per_node, 1)
            self.parallelism = dataclasses.replace(self.parallelism, nodes=1, gpus_per_node=gpus,
                                                   procs_per_node=1)


def register_configs() -> None:
    """Register every schema; called by each Hydra entry point before it composes. Hydra is
    imported here, not with this module: `switchyard status`, `show` and `logs` read the config's
    types and never compose (a tenth of a second of their start)."""
    from hydra.core.config_store import ConfigStore

    # ${pid:} in the default run and sweep directories: with the time to the microsecond, two
    # submissions never share one (conf/train.yaml, conf/run.yaml; launch/ownership.py)
    OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(group="parallelism", name="base_parallelism", node=ParallelismConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="container", name="base_container", node=ContainerConfig, package="cluster.container")
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="optim", name="base_optim", node=OptimConfig)
    cs.store(group="memory", name="base_memory", node=MemoryConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="logger", name="base_logger", node=LoggerConfig)
    cs.store(group="model", name="base_mlp", node=MlpConfig)
    cs.store(group="model", name="base_transformer", node=TransformerConfig)
    cs.store(group="model", name="base_gpt", node=GptConfig)
    cs.store(group="task", name="base_classify", node=ClassifyTaskConfig)
    cs.store(group="task", name="base_regress", node=RegressTaskConfig)
    cs.store(group="task", name="base_causal_lm", node=CausalLmTaskConfig)


@dataclass(frozen=True)
class AppGroups:
    """What an app's check hands the sweep launcher for one point: its groups, the modules its
    ranks import before their first step (forked from one import where ``cluster.forks_ranks``;
    none: each rank is started as its own process), and whether a point's process runs only
    Switchyard's code (``own_code``: ``jobs.train``, ``switchyard run``; it then ends without the
    interpreter's teardown, ``launch/job_entry.py``). A user's own app runs its Python there."""

    cluster: ClusterConfig
    parallelism: ParallelismConfig
    rank_modules: tuple[str, ...] = ()
    own_code: bool = False


# An app's own checks before submission, by its config schema. An entry point registers its check
# (jobs.train does) and the sweep launcher runs it on every point: the launcher reaches the app's
# checks without orchestrator importing jobs. The check takes the point's composed config.
AppCheck = Callable[[Any], AppGroups]
_APP_CHECKS: dict[type, AppCheck] = {}


def register_app_check(schema: type, check: AppCheck) -> None:
    _APP_CHECKS[schema] = check


def app_check(schema: type | None) -> AppCheck | None:
    return None if schema is None else _APP_CHECKS.get(schema)


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys a composed config holds that its dataclass schema does not declare, with a fix each.

    Hydra's ``+optim.lrr=1e-3`` adds a key to a structured config, ``OmegaConf.to_object`` keeps it
    as a stray attribute, and nothing ever reads it: the run would train with the default. Groups
    without a dataclass (``model=custom``: any constructor keys) are not checked.
    """
    schema = OmegaConf.get_type(node)
    declared = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    errors = []
    for key in map(str, node):
        value = OmegaConf.select(node, key, throw_on_missing=False)
        if declared is not None and key not in declared:
            close = difflib.get_close_matches(key, declared, n=1)
            fix = f"{prefix}{close[0]}=..." if close else f"one of {prefix}{{{','.join(declared)}}}"
            errors.append(str(invalid(f"{prefix}{key}", value, f"{prefix.rstrip('.') or 'the config'} "
                                      f"has no key {key!r}, so nothing would read it", fix)))
        elif isinstance(value, DictConfig):
            errors += unknown_keys(value, f"{prefix}{key}.")
    return errors


# ------------------------------------------------------------------------------------------------
# Groups built from a `_target_` (model, task): what their schema holds, and the class it names


def group_dict(spec: Any) -> dict[str, Any]:
    """A ``_target_`` group as a plain dict: a built-in's dataclass, or a custom one's mapping."""
    return dict(dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) and not isinstance(spec, type)
                else spec)


def import_target(group: str, target: Any, examples: str) -> Any:
    """The class ``{group}._target_`` names, or a ConfigError naming the value and the fix."""
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(f"{group}._target_={target!r} is invalid: it must be a dotted path to a "
                          f"{group} class (try {examples}, or {group}._target_=my_pkg.Name)")
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{group}._target_={target!r} cannot be imported ({e}) (try {examples}, "
                          f"or a class importable on every node)") from e
