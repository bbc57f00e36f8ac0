"""Process-group start-up that cannot collide on a port and fails fast instead of hanging.

Hashing the job id into a port (submitit, Lightning) collides when two jobs share a node. Here rank 0
asks the OS for a free port (a TCPStore bound to port 0), then publishes ``host:port`` in a file in
the job's directory, which every rank can read (submitit requires that directory to be shared). The
file name carries the job id and restart count, so a requeued job never reads its previous run's
address. Every wait has a deadline with a message that says what to check.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from durable import atomic
from orchestrator.launch import gloo_interface
from orchestrator.launch.dist_env import DistEnv

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

# torch is imported where a store or a group is made, not here: `switchyard run`'s rank wrappers
# read and write the endpoint files alone, and only rank 0's serves a store (rank_env).

DEFAULT_RENDEZVOUS_TIMEOUT_S = 180.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


class RendezvousError(RuntimeError):
    """The ranks could not find each other; the message says which side and what to check."""


class RankZeroFailedError(RendezvousError):
    """Rank 0 published a failure instead of its address; it reports the error itself."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


def endpoint_file(rdzv_dir: Path, env: DistEnv) -> Path:
    return rdzv_dir / f"rdzv-{env.job_id}-r{env.attempt}.json"


def resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise RendezvousError(
            f"master address {host!r} (the node of rank 0) does not resolve on "
            f"{socket.gethostname()}: add it to DNS or /etc/hosts (the local cluster does this "
            f"in `switchyard cluster up`)") from e


def publish(path: Path, endpoint: Endpoint) -> None:
    # Readers poll for this file: they must see all of it or nothing.
    atomic.write_json(path, {"host": endpoint.host, "port": endpoint.port}, durable=False)


def publish_failure(path: Path, message: str) -> None:
    """Rank 0 failed before serving the store: the ranks waiting for its address stop now, with its
    reason, instead of at the rendezvous timeout (an srun without --kill-on-bad-exit, say)."""
    atomic.write_json(path, {"error": message}, durable=False)


def wait_for_endpoint(path: Path, timeout_s: float) -> Endpoint:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
            if "error" in data:
                raise RankZeroFailedError(f"rank 0 stopped before training: {data['error']}")
            return Endpoint(host=str(data["host"]), port=int(data["port"]))
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise RendezvousError(
        f"rank 0 did not publish its address in {path} within {timeout_s:.0f} s: check that rank 0 "
        f"started (its log), and that {path.parent} is on a file system every node shares. "
        f"Raise cluster.rendezvous_timeout_s if the nodes start far apart.")


def start_store(env: DistEnv, rdzv_dir: Path, timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves the store on a free port; the others connect to what it published."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if env.master_port is not None:  # torchrun already chose and serves the port
        resolve(env.master_addr)
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                             env.is_main and not env.agent_store, timeout=timeout,
                             wait_for_workers=False)
    path = endpoint_file(rdzv_dir, env)
    if env.is_main:
        resolve(env.master_addr)
        store = dist.TCPStore(env.master_addr, 0, env.world_size, True, timeout=timeout,
                              wait_for_workers=False)
        publish(path, Endpoint(env.master_addr, store.port))
        return store
    endpoint = wait_for_endpoint(path, timeout_s)
    resolve(endpoint.host)
    try:
        return dist.TCPStore(endpoint.host, endpoint.port, env.world_size, False, timeout=timeout)
    except (RuntimeError, dist.DistStoreError) as e:
        raise RendezvousError(f"rank {env.rank} on {env.hostname} cannot reach rank 0's store at "
                              f"{endpoint.host}:{endpoint.port} within {timeout_s:.0f} s: {e}") from e


def choose_backend(requested: str, device: torch.device | None) -> str:
    """``auto``: nccl for a rank on a CUDA device, else gloo. Decided by the rank's device, not by
    ``torch.cuda.is_available()``: a CPU run (``gpus_per_node=0``) on a GPU machine is gloo."""
    if requested == "auto":
        return "nccl" if device is not None and device.type == "cuda" else "gloo"
    return requested


def group_backend(device_backend: str) -> str:
    """The process group's backend string for a device backend.

    NCCL moves only CUDA tensors: on an NCCL-only group, an all_reduce of a CPU tensor (a stop flag,
    a count) fails with "No backend type associated with device type cpu". So any backend other than
    gloo gets gloo beside it for CPU tensors: ``cpu:gloo,cuda:nccl``. Each collective then goes to
    the backend of its tensor's device: gradients and device-resident metrics over NCCL, control
    values (CPU tensors, pickled objects) over gloo, off the GPU's stream.
    """
    return "gloo" if device_backend == "gloo" else f"cpu:gloo,cuda:{device_backend}"


def init_process_group(env: DistEnv, rdzv_dir: Path, *, backend: str = "auto",
                       device: torch.device | None = None,
                       rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
                       collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> str:
    """Join the job's process group; returns the device backend used (``nccl`` or ``gloo``).

    On GPU the caller sets the device from the local rank first (see ``orchestrator.training.runtime``)
    and passes it as ``device``: NCCL's communicator is bound to it, never to GPU 0 for every rank.
    """
    import torch.distributed as dist

    chosen = choose_backend(backend, device)
    store = start_store(env, rdzv_dir, rendezvous_timeout_s)
    bind_gloo(env, store, rendezvous_timeout_s)
    dist.init_process_group(group_backend(chosen), store=store, rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s),
                            device_id=device if device is not None and device.type == "cuda" else None)
    return chosen


def bind_gloo(env: DistEnv, store: dist.Store, timeout_s: float) -> str | None:
    """A job over several nodes: gloo binds an interface the other nodes reach, not the loopback
    address the hostname may resolve to (see ``gloo_interface``). A rank off node 0 routes to rank
    0's node; node 1's first rank publishes its own address in the store, and node 0's ranks, which
    have no other node's address, route back to it. Returns the interface chosen, if any."""
    import torch.distributed as dist

    if env.num_nodes <= 1:
        return None
    key = f"{gloo_interface.PEER_KEY}/{env.attempt}"
    if env.node_rank != 0:
        peer = resolve(env.master_addr)
        if env.node_rank == 1 and env.is_local_main:  # published whatever this rank's own setting
            store.set(key, gloo_interface.route_source(peer))
    elif not gloo_interface.needs_interface(env):
        return None
    else:
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError) as e:
            raise RendezvousError(f"rank {env.rank} on {env.hostname} waited {timeout_s:.0f} s for node "
                                  f"1 to publish its address (gloo needs an interface that reaches "
                                  f"it): check that node 1's ranks started (their logs)") from e
        peer = store.get(key).decode()
    if not gloo_interface.needs_interface(env):
        return None
    name = gloo_interface.choose(peer)
    if name is not None and env.is_local_main:
        host = socket.gethostname()
        print(f"gloo: {host} resolves to {gloo_interface.hostname_address(host)} (loopback), so gloo "
              f"binds {name}, the interface that reaches {peer} ({gloo_interface.IFNAME_ENV}={name})",
              flush=True)
    return name


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
