"""Multi-node gloo on a node whose hostname resolves to loopback (stock Ubuntu's 127.0.1.1).

The two "nodes" are two processes on this host, rank 0's node reached at this host's own network
address, so gloo really binds the interface chosen and really all-reduces over it. Only the
hostname's resolution is rewritten: this host's /etc/hosts is not stock Ubuntu's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from orchestrator.launch import gloo_interface, rendezvous
from orchestrator.launch.dist_env import DistEnv

UBUNTU_HOSTNAME_ADDRESS = "127.0.1.1"


def network_address() -> tuple[str, str] | None:
    """(interface, IPv4 address) of one interface that is not loopback, if this host has one."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and not gloo_interface.is_loopback(a.address):
                return name, a.address
    return None


def hostname_at_ubuntu_loopback() -> Any:
    """socket.getaddrinfo, but this host's name resolves to 127.0.1.1."""
    real, hostname = socket.getaddrinfo, socket.gethostname()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == hostname:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (UBUNTU_HOSTNAME_ADDRESS, 0))]
        return real(host, *args, **kwargs)

    return getaddrinfo


def node_env(node: int, master: str, **kw: Any) -> DistEnv:
    return DistEnv(rank=node, local_rank=0, world_size=2, local_world_size=1, node_rank=node,
                   num_nodes=2, master_addr=master, hostname=f"node{node}", job_id="gloo-if",
                   restart_count=0, source="slurm", **kw)


def _node(node: int, master: str, rdzv: str, out: mp.Queue) -> None:
    os.environ.pop(gloo_interface.IFNAME_ENV, None)
    socket.getaddrinfo = hostname_at_ubuntu_loopback()  # this spawned process's own socket module
    rendezvous.init_process_group(node_env(node, master), Path(rdzv), backend="gloo",
                                  rendezvous_timeout_s=30, collective_timeout_s=30)
    t = torch.tensor([node + 1.0])
    dist.all_reduce(t)
    out.put((node, os.environ.get(gloo_interface.IFNAME_ENV), t.item()))
    rendezvous.destroy_process_group()


def test_loopback_hostname_binds_gloo_to_the_interface_that_reaches_the_other_node(tmp_path: Path) -> None:
    found = network_address()
    if found is None:
        pytest.skip("this host has no interface but loopback")
    interface, address = found
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_node, args=(n, address, str(tmp_path), out)) for n in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, interface, 3.0), (1, interface, 3.0)]


def test_a_gloo_interface_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", hostname_at_ubuntu_loopback())
    env = node_env(1, "127.0.0.1")
    assert gloo_interface.needs_interface(env, {})
    assert not gloo_interface.needs_interface(env, {gloo_interface.IFNAME_ENV: "ib0"})


def test_one_node_and_a_network_hostname_need_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", hostname_at_ubuntu_loopback())
    one_node = DistEnv(rank=0, local_rank=0, world_size=8, local_world_size=8, node_rank=0, num_nodes=1,
                       master_addr="n1", hostname="n1", job_id="j", restart_count=0, source="slurm")
    assert not gloo_interface.needs_interface(one_node, {})
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0))])
    assert not gloo_interface.needs_interface(node_env(1, "n1"), {})


def test_nodes_on_one_host_keep_loopback() -> None:
    environ: dict[str, str] = {}
    assert gloo_interface.choose("127.0.0.1", environ) is None and environ == {}


def test_no_interface_holding_the_route_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    found = network_address()
    if found is None:
        pytest.skip("this host has no interface but loopback")
    monkeypatch.setattr(socket, "getaddrinfo", hostname_at_ubuntu_loopback())
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {})
    with pytest.raises(gloo_interface.InterfaceError,
                       match=rf"{socket.gethostname()} resolves to 127\.0\.1\.1 .*GLOO_SOCKET_IFNAME="):
        gloo_interface.choose(found[1], {})

