"""What a user's own process sees as one rank: the variables torchrun gives its workers.

An unmodified torchrun-style script calls ``dist.init_process_group(backend)`` and reads ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. The port
must be free on rank 0's node, and picking a "free" port then handing it to another process races
with every other job on the node. So, as torchrun's agent does, the Switchyard process that starts
rank 0 serves the TCPStore itself, on a port the OS gives it (``rendezvous``: published in the
run directory, so no other job can collide with it), and every rank joins as a client
(``TORCHELASTIC_USE_AGENT_STORE=True``, which torch's ``env://`` rendezvous reads).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import EXPORTED_ENV, DistEnv

RUN_DIR_ENV = "SWITCHYARD_RUN_DIR"
JOB_ID_ENV = "SWITCHYARD_JOB_ID"
RESTART_ENV = "SWITCHYARD_RESTART_COUNT"
MAX_REQUEUES_ENV = "SWITCHYARD_MAX_REQUEUES"


def torchrun_variables(env: DistEnv, endpoint: rendezvous.Endpoint) -> dict[str, str]:
    """The variables torchrun gives each of its workers, for the rank ``env`` whose job's store
    ``endpoint`` serves."""
    return {
        "RANK": str(env.rank), "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size), "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank), "ROLE_RANK": str(env.rank), "ROLE_WORLD_SIZE": str(env.world_size),
        "MASTER_ADDR": endpoint.host, "MASTER_PORT": str(endpoint.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client of the store served here
        "TORCHELASTIC_RESTART_COUNT": str(env.restart_count),
    }


def rank_variables(env: DistEnv, endpoint: rendezvous.Endpoint, run_dir: Path,
                   max_requeues: int) -> dict[str, str]:
    """The variables one rank's process gets, torchrun's names first, then Switchyard's."""
    return {
        **torchrun_variables(env, endpoint),
        RUN_DIR_ENV: str(run_dir), JOB_ID_ENV: env.job_id, RESTART_ENV: str(env.restart_count),
        MAX_REQUEUES_ENV: str(max_requeues),
    }


@contextlib.contextmanager
def exported(env: DistEnv, rdzv_dir: Path) -> Iterator[None]:
    """Inside, this process (a rank of ``jobs.train``, which joined its process group in place)
    has torchrun's variables in ``os.environ``, as a torchrun worker would: a user's model, or a
    library it calls (rank-0-only logging, device placement, HF and W&B helpers), reads them.
    Called once the rank has joined: rank 0 has published the store's address by then. Restored
    on the way out, since a debug run's rank is the submitting process itself.

    ``dist_env.EXPORTED_ENV`` marks them as this process's own, so ``dist_env.detect`` goes on
    reading the launcher's (SLURM's, submitit's) rather than taking them for a torchrun launch.
    Under a real torchrun (``env.source``) they are torchrun's already and stay as they are."""
    if env.source == "torchrun":
        yield
        return
    endpoint = rendezvous.wait_for_endpoint(rendezvous.endpoint_file(rdzv_dir, env), timeout_s=10.0)
    variables = {**torchrun_variables(env, endpoint), EXPORTED_ENV: "1"}
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def serve_or_find_store(env: DistEnv, rdzv_dir: Path, timeout_s: float
                        ) -> tuple[Any | None, rendezvous.Endpoint]:
    """Rank 0: serve the job's TCPStore on a free port and publish it; -> (store, endpoint). Other
    ranks: wait for what rank 0 published; -> (None, endpoint). The store lives as long as the
    returned object: rank 0's caller keeps it until every rank's process has ended."""
    path = rendezvous.endpoint_file(rdzv_dir, env)
    if not env.is_main:
        endpoint = rendezvous.wait_for_endpoint(path, timeout_s)
        rendezvous.resolve(endpoint.host)
        return None, endpoint
    # Only rank 0's wrapper serves the store, so only it imports torch (a second of CPU): the
    # other ranks' wrappers start the user's command without it (8 per node on a GPU cluster).
    import torch.distributed as dist

    rendezvous.resolve(env.master_addr)
    store = dist.TCPStore(env.master_addr, 0, env.world_size, True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    endpoint = rendezvous.Endpoint(env.master_addr, store.port)
    rendezvous.publish(path, endpoint)
    return store, endpoint


def done_file(rdzv_dir: Path, env: DistEnv, rank: int) -> Path:
    """Written by each rank's wrapper when its process has ended: rank 0 keeps the store until
    every rank's is there (a script's last barrier or destroy_process_group still needs it)."""
    return rdzv_dir / f"done-{env.job_id}-r{env.attempt}-{rank}"


def environment_record(environ: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """The parts of an environment worth keeping in the run directory (no secrets: named keys only)."""
    return {k: environ[k] for k in keys if k in environ}


class AttemptNotOver(SystemExit):
    """Raised by a rank leaving without a result because the job goes on elsewhere: requeued, or
    stopped by SLURM for preemption. The sweep launcher's status report lets it pass, as it lets
    the trainer's ``JobStopped``: the attempt has not ended. ``stop_reason``, as JobStopped's:
    the rank's entry point records that it stopped, not died (``submit.mark_stopped``)."""

    stop_reason = "a stop request (SIGTERM, or a requeue)"
