"""Which network interface gloo binds when a job spans nodes.

Every process group here holds gloo (beside NCCL on GPUs, for CPU tensors). Unless
``GLOO_SOCKET_IFNAME`` names an interface, gloo binds the first address the machine's hostname
resolves to and tells the other ranks to connect there. On a stock Ubuntu node ``/etc/hosts`` maps
the hostname to ``127.0.1.1``: the ranks on other nodes then connect to their own loopback and
fail, or wait out the collective timeout. NCCL is not affected (it skips ``lo`` by itself).

So before the process group starts, a rank whose hostname resolves to a loopback address, in a job
over more than one node, binds gloo to the interface that carries its traffic to the other nodes:
the one whose address the kernel picks as the source of a route to them (a UDP ``connect`` sends
nothing; ``getsockname`` reads the choice). A route that is itself loopback means the "other" node
is this host (the local cluster's nodes are one machine): loopback is right there. A
``GLOO_SOCKET_IFNAME`` the user set is kept.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping

import psutil

from orchestrator.launch.dist_env import DistEnv

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
# node 1's first rank publishes the address it reaches rank 0's node from; node 0 routes back to it
PEER_KEY = "switchyard/gloo-peer-address"


class InterfaceError(RuntimeError):
    """No interface here reaches the other nodes; the message names the hostname and the fix."""


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def hostname_address(hostname: str) -> str:
    """The address gloo binds without ``GLOO_SOCKET_IFNAME``: the hostname's first resolution, or
    loopback, where gloo falls back when the hostname does not resolve."""
    try:
        return str(socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return "127.0.0.1"


def route_source(address: str) -> str:
    """This host's address on the route to ``address`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def interface_of(address: str, interfaces: Mapping[str, list[str]] | None = None) -> str | None:
    """The name of the interface that holds ``address`` (``psutil.net_if_addrs()`` by default)."""
    if interfaces is None:
        interfaces = {name: [a.address for a in addrs] for name, addrs in psutil.net_if_addrs().items()}
    for name, addresses in interfaces.items():
        if any(a.split("%")[0] == address for a in addresses):
            return name
    return None


def needs_interface(env: DistEnv, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this rank's gloo would bind loopback in a job over several nodes."""
    environ = os.environ if environ is None else environ
    return env.num_nodes > 1 and not environ.get(IFNAME_ENV) \
        and is_loopback(hostname_address(socket.gethostname()))


def choose(peer_address: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``peer_address`` (a node other than
    this one); returns its name, or None where loopback reaches it (the same host)."""
    environ = os.environ if environ is None else environ
    source = route_source(peer_address)
    if is_loopback(source):
        return None
    name = interface_of(source)
    if name is None:
        hostname = socket.gethostname()
        raise InterfaceError(
            f"{hostname} resolves to {hostname_address(hostname)} (loopback), which ranks on other "
            f"nodes cannot reach, and no interface here holds {source}, the address that reaches "
            f"{peer_address}: set {IFNAME_ENV} to the interface the nodes share (export "
            f"{IFNAME_ENV}=eth0, say), or map {hostname} to its network address in /etc/hosts")
    environ[IFNAME_ENV] = name
    return name
