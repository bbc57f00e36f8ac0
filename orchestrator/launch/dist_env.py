"""The one reader of the launcher's environment (SLURM, torchrun, submitit's local mode).

Everything else asks :func:`detect` for a frozen :class:`DistEnv` instead of reading ``os.environ``,
so the question "which rank am I, and who is rank 0" has exactly one answer in the code base.

Precedence, most specific first: submitit's local executor (``SUBMITIT_LOCAL_GLOBALID``), torchrun
(``TORCHELASTIC_RUN_ID``, or its rank variables where Switchyard did not export them itself), a
SLURM job step (``SLURM_STEP_ID``), else a single process. A torchrun or local launch inside an
``salloc`` shell therefore is not mistaken for the surrounding allocation.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Source = Literal["slurm", "torchrun", "local", "single"]

# Set beside torchrun's variables where a Switchyard rank exported them itself (``rank_env.exported``):
# they describe the launch this module read, so they are not a torchrun launch of their own.
EXPORTED_ENV = "SWITCHYARD_TORCHRUN_VARS"


class DistEnvError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job. Ranks count processes; nodes count hosts."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str  # host of rank 0; torchrun gives it, SLURM's is the first host of the node list
    hostname: str  # this process's node, as the launcher names it (SLURMD_NODENAME on SLURM)
    job_id: str  # unique per job (array jobs: ARRAYID_TASKID); rendezvous files are keyed on it
    restart_count: int  # SLURM_RESTART_COUNT: 0 on the first run, +1 per requeue
    source: Source
    master_port: int | None = None  # torchrun fixes the port; elsewhere rank 0 picks a free one
    agent_store: bool = False  # torchrun's agent already serves the store: every rank is a client
    restart: int = 0  # SWITCHYARD_RESTART: restarts inside this allocation (cluster.restarts)

    @property
    def attempt(self) -> str:
        """This start of the job, for files every rank of it shares (a rendezvous): the requeue
        count, and the restart inside the allocation where there is one."""
        return f"{self.restart_count}" if not self.restart else f"{self.restart_count}.{self.restart}"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        return _from_submitit_local(env)
    if "TORCHELASTIC_RUN_ID" in env or (
            "RANK" in env and "LOCAL_RANK" in env and "WORLD_SIZE" in env and EXPORTED_ENV not in env):
        return _from_torchrun(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm(env)
    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", hostname=socket.gethostname(), job_id=f"single-{os.getpid()}",
                   restart_count=0, source="single")


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None:
        if default is None:
            raise DistEnvError(f"environment variable {key} is missing: was this process started "
                               f"by srun, torchrun or submitit?")
        return default
    try:
        return int(value)
    except ValueError as e:
        raise DistEnvError(f"environment variable {key}={value!r} is not an integer") from e


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    world_size = _int(env, "SLURM_NTASKS")
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise DistEnvError("SLURM_JOB_NODELIST is missing: cannot tell which node hosts rank 0")
    tasks_per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                           or env.get("SLURM_TASKS_PER_NODE") or "")
    node_rank = _int(env, "SLURM_NODEID")
    local_world = tasks_per_node[node_rank] if node_rank < len(tasks_per_node) \
        else world_size // max(num_nodes, 1)
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else _str(env, "SLURM_JOB_ID")
    return DistEnv(rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID"),
                   world_size=world_size, local_world_size=local_world, node_rank=node_rank,
                   num_nodes=num_nodes, master_addr=first_host(nodelist),
                   hostname=env.get("SLURMD_NODENAME") or socket.gethostname(), job_id=job_id,
                   restart_count=_int(env, "SLURM_RESTART_COUNT", 0), source="slurm",
                   restart=_int(env, "SWITCHYARD_RESTART", 0))


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world_size = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world_size)
    return DistEnv(rank=_int(env, "RANK"), local_rank=_int(env, "LOCAL_RANK"), world_size=world_size,
                   local_world_size=local_world, node_rank=_int(env, "GROUP_RANK", 0),
                   num_nodes=max(world_size // max(local_world, 1), 1),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   hostname=env.get("SLURMD_NODENAME") or socket.gethostname(),  # under srun: n1
                   job_id=env.get("TORCHELASTIC_RUN_ID", "torchrun"),
                   restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0), source="torchrun",
                   master_port=_int(env, "MASTER_PORT", 29500),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")


def _from_submitit_local(env: Mapping[str, str]) -> DistEnv:
    world_size = _int(env, "SUBMITIT_LOCAL_NTASKS")
    return DistEnv(rank=_int(env, "SUBMITIT_LOCAL_GLOBALID"), local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID"),
                   world_size=world_size, local_world_size=world_size, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", hostname=socket.gethostname(),
                   job_id=_str(env, "SUBMITIT_LOCAL_JOB_ID"), restart_count=0, source="local")


def _str(env: Mapping[str, str], key: str) -> str:
    value = env.get(key)
    if not value:
        raise DistEnvError(f"environment variable {key} is missing")
    return value


_BRACKET = re.compile(r"^([^\[,]*)\[([^\]]+)\](.*)$")


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``n[1-2]`` -> ``n1``, ``gpu[007,009]`` -> ``gpu007``."""
    head = _split_top_level(nodelist)[0]
    match = _BRACKET.match(head)
    if match is None:
        return head
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return [p for p in parts if p]


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (SLURM_TASKS_PER_NODE's compressed form)."""
    result: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise DistEnvError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        result += [int(match.group(1))] * int(match.group(2) or 1)
    return result


IN_JOB_ENV = "SWITCHYARD_IN_JOB"


def attached_launch(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """This process's place in a launch that already happened outside Switchyard, or None.

    Several tasks of an ``srun`` step, or a worker of ``torchrun`` (standalone, or under srun on
    several nodes): the ranks are placed, so the entry point trains here as one of them instead of
    submitting a job of its own per task. A single task (``srun -n1``, a batch script's shell) and
    Switchyard's own tasks (submitit's, the sweep launcher's) are not attached.
    """
    env = os.environ if environ is None else environ
    if inside_launched_job(env) or "SUBMITIT_LOCAL_GLOBALID" in env or "SUBMITIT_FOLDER" in env:
        return None
    found = detect(env)
    if found.source == "torchrun" or (found.source == "slurm" and found.world_size > 1):
        return found
    return None


def launch_name(environ: Mapping[str, str] | None = None) -> str | None:
    """A name every rank of an attached launch computes alike (``slurm-12-step0``,
    ``torchrun-<run id>``), stable across a requeue of the same job; None when not attached."""
    env = os.environ if environ is None else environ
    found = attached_launch(env)
    if found is None:
        return None
    if found.source == "torchrun":
        return f"torchrun-{found.job_id}"
    return f"slurm-{found.job_id}-step{env.get('SLURM_STEP_ID', '0')}"


def inside_launched_job(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a task that Switchyard's sweep launcher started: the ranks are already placed,
    so the entry point must train here instead of submitting another job."""
    env = os.environ if environ is None else environ
    return env.get(IN_JOB_ENV) == "1"
