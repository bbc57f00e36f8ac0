"""Which transport NCCL chose between the GPUs, as one line in the run's log.

A node's GPUs talk over P2P (NVLink, or PCIe) only where each rank's process can see the others'
GPUs. Under ``--gpus-per-task=1`` with SLURM's ``ConstrainDevices``, each task's cgroup holds one
GPU, and NCCL can fall back to SHM (through host memory) or even the network inside one node, at a
fraction of NVLink's bandwidth, with nothing in the log to say so. So, unless the user set
``NCCL_DEBUG`` or ``NCCL_DEBUG_FILE`` themselves, each GPU rank has NCCL write its start-up log
(``NCCL_DEBUG=INFO``, subsystems ``INIT,GRAPH`` only) to ``RUN/nccl/rank-N.log``; after the first
collectives the ranks read the transports from their own lines, and rank 0 prints, say,
``nccl transport: P2P/IPC over NVLink within nodes, NET/IB (GPUDirect RDMA) across nodes``.

The lines read, as NCCL writes them (``transport/p2p.cc``, ``net.cc``, ``shm.cc``; ``graph/search.cc``)::

    host:919:1150 [0] NCCL INFO Channel 01/0 : 8[0] -> 15[7] via P2P/IPC/read
    host:926:1151 [7] NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3
    host:454:461 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 16, bw 40.0/40.0, type NVL/PIX, sameChannels 1

``Pattern 4`` is the ring search; its ``type`` is the slowest link inside a node / to the NIC.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

LOG_DIR = "nccl"  # RUN/nccl/rank-N.log
SUBSYSTEMS = "INIT,GRAPH"  # the channel lines are INIT|P2P; the ring's link type is GRAPH

_VIA = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : \d+\[[0-9a-fA-F]+\] -> \d+\[[0-9a-fA-F]+\]"
                  r"(?: \[(?:send|receive)\])? via (.+?)\s*$")
_RING = re.compile(r"NCCL INFO Pattern 4, .*\btype (\w+)/(\w+)")
# NCCL's path types (graph/topo.h), the link between two GPUs of one node
LINKS = {"NVL": "NVLink", "NVB": "NVLink", "C2C": "NVLink-C2C", "XGMI": "xGMI", "PIX": "PCIe",
         "PXB": "PCIe", "PXN": "PCIe", "P2C": "PCIe", "PHB": "PCIe through the CPU",
         "SYS": "PCIe across CPU sockets"}


@dataclass
class Transports:
    """What one or more ranks' logs say."""

    within: set[str] = field(default_factory=set)  # P2P/IPC, P2P/CUMEM, SHM/direct, ...
    across: set[str] = field(default_factory=set)  # NET/IB (GPUDirect RDMA), NET/Socket, ...
    links: set[str] = field(default_factory=set)  # the ring's link inside a node: NVL, PIX, ...

    def merge(self, other: Transports) -> None:
        self.within |= other.within
        self.across |= other.across
        self.links |= other.links


def enable_debug_log(run_dir: Path, rank: int,
                     environ: MutableMapping[str, str] | None = None) -> Path | None:
    """Have NCCL write this rank's start-up log to ``RUN/nccl/rank-N.log``; call before the process
    group starts (NCCL reads these once). None, and nothing set, where the user set NCCL's logging."""
    env = os.environ if environ is None else environ
    if "NCCL_DEBUG" in env or "NCCL_DEBUG_FILE" in env:
        return None
    path = run_dir / LOG_DIR / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS=SUBSYSTEMS, NCCL_DEBUG_FILE=str(path))
    return path


def transport_name(via: str) -> str:
    """``P2P/IPC/read`` -> ``P2P/IPC``; ``NET/IB/0/GDRDMA`` -> ``NET/IB (GPUDirect RDMA)``;
    ``SHM/direct/direct`` -> ``SHM/direct``; ``P2P/direct pointer`` stays."""
    parts = via.split("/")
    kept = [p for p in parts[1:2] if not p.isdigit()]
    name = "/".join([parts[0], *kept])
    return f"{name} (GPUDirect RDMA)" if parts[0] == "NET" and "GDRDMA" in parts else name


def parse(lines: Iterable[str]) -> Transports:
    found = Transports()
    for line in lines:
        via = _VIA.search(line)
        if via is not None:
            name = transport_name(via.group(1))
            (found.across if name.startswith(("NET/", "COLLNET")) else found.within).add(name)
            continue
        ring = _RING.search(line)
        if ring is not None and ring.group(1) != "LOC":  # LOC: one GPU on the node, no link inside
            found.links.add(ring.group(1))
    return found


def read(path: Path | None) -> Transports:
    if path is None:
        return Transports()
    try:
        return parse(path.read_text(errors="replace").splitlines())
    except OSError:
        return Transports()


def describe(found: Transports) -> str | None:
    """The log's line, or None where NCCL reported no connection (no NCCL collective yet)."""
    if not found.within and not found.across:
        return None
    parts = []
    if found.within:
        links = sorted({LINKS.get(link, link) for link in found.links})
        over = f" over {' and '.join(links)}" if links else ""
        parts.append(f"{', '.join(sorted(found.within))}{over} within nodes")
    if found.across:
        parts.append(f"{', '.join(sorted(found.across))} across nodes")
    line = "nccl transport: " + ", ".join(parts)
    if found.within and not any(t.startswith("P2P") for t in found.within):
        line += (" (no P2P between a node's GPUs: each rank sees only its own GPU? see docs/gpus.md, "
                 "'The layout, and the transport NCCL chose', --gpus-per-task)")
    return line
