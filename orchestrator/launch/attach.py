"""Training inside a launch that already happened: the user's own ``srun`` or ``torchrun``.

Detected, not chosen (``dist_env.attached_launch``), as Lightning's ``SLURMEnvironment`` does: a
process that is one of several srun tasks or a torchrun worker can only mean "be one rank of this
launch". Submitting a job from each task instead (the old behaviour) started N unrelated jobs that
all wrote one run directory.

The launch decides the shape: ``parallelism.nodes`` and the tasks per node are taken from it. A
value set on the command line that contradicts it is refused before the first step, naming both,
since it says the user expected a different job than the one running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from orchestrator.config import ConfigError, ParallelismConfig
from orchestrator.launch import hang_dumps, heartbeat
from orchestrator.launch.dist_env import DistEnv


def explicit_keys(overrides: Iterable[str]) -> set[str]:
    """The keys a list of Hydra overrides sets (``+a.b=1``, ``a.b=1`` -> ``a.b``)."""
    return {o.lstrip("+~").split("=", 1)[0] for o in overrides}


def fit_to_launch(parallelism: ParallelismConfig, launch: DistEnv, explicit: set[str],
                  launcher: str, visible_gpus: int = 0) -> ParallelismConfig:
    """``parallelism`` shaped like the launch; a contradicting explicit value, or GPUs bound so
    that some task has none of its own (``visible_gpus``: what this task sees), is a ConfigError."""
    tasks_key = "parallelism.gpus_per_node" if parallelism.gpus_per_node > 0 else "parallelism.procs_per_node"
    tasks = parallelism.gpus_per_node or parallelism.procs_per_node
    if "parallelism.nodes" in explicit and parallelism.nodes != launch.num_nodes:
        raise ConfigError(f"parallelism.nodes={parallelism.nodes} contradicts the launch: {launcher} "
                          f"started {launch.num_nodes} node(s) (try parallelism.nodes="
                          f"{launch.num_nodes}, or leave it out: an attached run takes its shape "
                          f"from the launch)")
    if tasks_key in explicit and tasks != launch.local_world_size:
        unit = "GPU" if parallelism.gpus_per_node > 0 else "process"
        raise ConfigError(f"{tasks_key}={tasks} contradicts the launch: {launcher} started "
                          f"{launch.local_world_size} task(s) on node {launch.hostname}, and each "
                          f"task is one {unit} rank (try {tasks_key}={launch.local_world_size}, or "
                          f"leave it out)")
    if parallelism.gpus_per_node > 0:
        check_gpu_binding(launch, launcher, visible_gpus)
        return dataclasses.replace(parallelism, nodes=launch.num_nodes,
                                   gpus_per_node=launch.local_world_size)
    return dataclasses.replace(parallelism, nodes=launch.num_nodes, procs_per_node=launch.local_world_size)


def check_gpu_binding(launch: DistEnv, launcher: str, visible_gpus: int) -> None:
    """One GPU per task: each task sees its own (``--gpus-per-task=1``) or all of the node's
    (``--gpus-per-node``, each rank takes the one at its local rank). Anything between leaves
    some tasks without a GPU of their own."""
    per_node = launch.local_world_size
    if visible_gpus == 1 or visible_gpus >= per_node:
        return
    bound = "no GPU" if visible_gpus == 0 else f"{visible_gpus} GPUs"
    raise ConfigError(f"parallelism.gpus_per_node asks for one GPU per task, but {launcher} started "
                      f"{per_node} task(s) on node {launch.hostname} and this task sees {bound} "
                      f"(try srun --gpus-per-task=1, or --gpus-per-node={per_node}; or "
                      f"parallelism=cpu to train on CPU)")


def describe(launch: DistEnv) -> str:
    """'srun step of job 12' / 'torchrun', for messages."""
    return f"srun (job {launch.job_id})" if launch.source == "slurm" else "torchrun"


def hang_report(error: BaseException, run_dir: Path, launch: DistEnv) -> str | None:
    """For a collective that timed out on this rank: what ``cluster=slurm``'s failure report says
    (the heartbeats' verdict: the rank the others waited for, and why), to be printed by this rank
    if it is the lowest rank not blamed, else "" (another rank prints it). None for any other
    error. Every waiting rank times out alike, and their tracebacks named only themselves."""
    if not hang_dumps.is_collective_timeout(f"{type(error).__name__}: {error}"):
        return None
    world = launch.world_size
    found = heartbeat.verdict([b for b in heartbeat.read_beats(run_dir) if b.rank < world], world)
    reporter = min(set(range(world)) - set(found.ranks), default=0)
    if launch.rank != reporter:
        return ""
    lines = [f"collective timeout in {describe(launch)}: {found.summary}."]
    lines += [f"rank {rank}: {why}" for rank, why in sorted(found.why.items())]
    return "\n".join(lines)
