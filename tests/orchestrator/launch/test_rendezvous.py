"""Rendezvous through a published endpoint file, with real processes and real TCP."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_helpers import rank_processes

from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv


def make_env(rank: int, world: int, job_id: str = "j1", master: str = "127.0.0.1") -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0,
                   num_nodes=1, master_addr=master, hostname="localhost", job_id=job_id,
                   restart_count=0, source="local")


def _worker(rank: int, world: int, rdzv: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    env = make_env(rank, world)
    rendezvous.init_process_group(env, Path(rdzv), backend="gloo", rendezvous_timeout_s=30)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out.put((rank, t.item()))
    rendezvous.destroy_process_group()


def test_three_processes_meet_on_a_port_rank0_chose(tmp_path: Path) -> None:
    ctx = rank_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 3, str(tmp_path), out)) for r in range(3)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, 6.0), (1, 6.0), (2, 6.0)]
    assert all(p.exitcode == 0 for p in procs)


def test_two_jobs_on_one_host_get_different_ports(tmp_path: Path) -> None:
    stores = [rendezvous.start_store(make_env(0, 2, job_id=j), tmp_path, 5) for j in ("a", "b")]
    ports = {rendezvous.wait_for_endpoint(rendezvous.endpoint_file(tmp_path, make_env(1, 2, job_id=j)),
                                          1).port for j in ("a", "b")}
    assert ports == {s.port for s in stores} and len(ports) == 2


def test_requeued_job_does_not_read_the_previous_runs_address(tmp_path: Path) -> None:
    first = make_env(1, 2)
    second = dataclasses.replace(first, restart_count=1)
    rendezvous.publish(rendezvous.endpoint_file(tmp_path, first), rendezvous.Endpoint("h", 1))
    assert rendezvous.endpoint_file(tmp_path, first) != rendezvous.endpoint_file(tmp_path, second)


def test_missing_rank0_fails_fast_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(rendezvous.RendezvousError, match=r"rank 0 did not publish.*shares"):
        rendezvous.start_store(make_env(1, 2), tmp_path, timeout_s=0.5)


def test_unresolvable_master_is_named(tmp_path: Path) -> None:
    with pytest.raises(rendezvous.RendezvousError, match=r"'no-such-node\.invalid' .*does not resolve"):
        rendezvous.start_store(make_env(0, 2, master="no-such-node.invalid"), tmp_path, 1)
