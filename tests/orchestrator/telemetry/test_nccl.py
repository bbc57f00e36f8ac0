"""The transport NCCL chose, read from its own log lines (real ones, from NCCL users' reports), and
the environment that has NCCL write them: no GPU needed for either."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.telemetry import nccl
from orchestrator.training import runtime

# 2 nodes x 8 GPUs, ring through the nodes over TCP (NVIDIA/nccl issue 952)
TWO_NODES_SOCKET = """\
node7:919:1150 [0] NCCL INFO Channel 01/0 : 8[0] -> 15[7] via P2P/IPC/read
node7:926:1151 [7] NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3
node7:921:1146 [2] NCCL INFO Channel 00/0 : 10[2] -> 9[1] via P2P/IPC/read
""".splitlines()
# the older format, InfiniBand with GPUDirect RDMA (NVIDIA/nccl issue 429)
TWO_NODES_IB = """\
machine-1:16194:18583 [3] NCCL INFO Channel 00 : 11[3e000] -> 9[1b000] via P2P/direct pointer
machine-1:16194:18586 [6] NCCL INFO Channel 03 : 7[b2000] -> 14[b1000] [receive] via NET/IB/0/GDRDMA
""".splitlines()
# 8 NVLink GPUs on one node: the ring's search result, then its channels
ONE_NODE_NVLINK = """\
hostA:12345:12345 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 12, bw 20.000000/20.000000, type NVL/PIX, \
sameChannels 1
hostA:12345:12345 [0] NCCL INFO Channel 31/1 : 5[5] -> 0[0] via P2P/IPC
hostA:12345:12345 [0] NCCL INFO Channel 02/0 : 3[3] -> 4[4] via P2P/CUMEM/read
""".splitlines()
# two GPUs of one node that cannot reach each other directly: through host memory
ONE_NODE_SHM = """\
NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct
NCCL INFO Channel 01 : 0[0] -> 1[1] via SHM/direct
NCCL INFO Pattern 4, crossNic 0, nChannels 1, bw 20.000000/20.000000, type PHB/PIX
""".splitlines()


def test_the_transports_are_named_within_and_across_nodes() -> None:
    assert nccl.describe(nccl.parse(TWO_NODES_SOCKET)) == \
        "nccl transport: P2P/IPC within nodes, NET/Socket across nodes"
    assert nccl.describe(nccl.parse(TWO_NODES_IB)) == \
        "nccl transport: P2P/direct pointer within nodes, NET/IB (GPUDirect RDMA) across nodes"
    assert nccl.describe(nccl.parse(ONE_NODE_NVLINK)) == \
        "nccl transport: P2P/CUMEM, P2P/IPC over NVLink within nodes"


def test_shm_between_a_nodes_gpus_points_at_the_layout() -> None:
    line = nccl.describe(nccl.parse(ONE_NODE_SHM))
    assert line is not None and line.startswith(
        "nccl transport: SHM/direct over PCIe through the CPU within nodes (no P2P between a node's GPUs")
    assert "--gpus-per-task" in line


def test_no_connection_yet_says_nothing() -> None:
    init_only = ["host:1:1 [0] NCCL INFO comm 0x5a0ca40 rank 1 nranks 4 cudaDev 1 nvmlDev 1 - Init COMPLETE",
                 "host:1:1 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 16, bw 40.0/40.0, type LOC/PIX"]
    assert nccl.describe(nccl.parse(init_only)) is None
    assert nccl.describe(nccl.read(None)) is None


def test_the_debug_log_goes_to_the_run_unless_the_user_set_ncclS_logging(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    path = nccl.enable_debug_log(tmp_path, 3, environ)
    assert path == tmp_path / "nccl" / "rank-3.log" and path.parent.is_dir()
    assert environ == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH", "NCCL_DEBUG_FILE": str(path)}
    for users in ({"NCCL_DEBUG": "WARN"}, {"NCCL_DEBUG_FILE": "/tmp/mine.%h.%p"}):
        kept = dict(users)
        assert nccl.enable_debug_log(tmp_path, 0, kept) is None and kept == users


class ReachedNccl(Exception):
    """Raised where the NCCL group would start: the test has seen what it needs."""


def test_a_gpu_rank_has_nccl_write_its_log_before_the_group_starts(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    for key in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="aaaa"))
    seen: dict[str, str | None] = {}

    def nccl_group_starts(*args: object, **kwargs: object) -> str:
        seen["file"] = os.environ.get("NCCL_DEBUG_FILE")
        raise ReachedNccl

    monkeypatch.setattr(rendezvous, "init_process_group", nccl_group_starts)
    env = DistEnv(rank=5, local_rank=0, world_size=8, local_world_size=1, node_rank=5, num_nodes=8,
                  master_addr="127.0.0.1", hostname="n6", job_id="j", restart_count=0, source="slurm")
    with pytest.raises(ReachedNccl):
        runtime.start(env, ParallelismConfig(gpus_per_node=1), ClusterConfig(), tmp_path / "rdzv",
                      run_dir=tmp_path)
    assert seen == {"file": str(tmp_path / "nccl" / "rank-5.log")}


def test_rank_0_prints_what_every_ranks_log_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One rank here, on gloo: the report's collective and its line, as an NCCL run makes them."""
    log = tmp_path / "rank-0.log"
    log.write_text("\n".join(TWO_NODES_SOCKET) + "\n")
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", hostname="localhost", job_id="nccl-report", restart_count=0,
                  source="local")
    rt = runtime.start(env, ParallelismConfig(gpus_per_node=0), ClusterConfig(), tmp_path / "rdzv")
    try:
        assert runtime.report_nccl_transport(rt) is None  # a gloo run has no NCCL to report
        as_nccl = runtime.Runtime(env=env, device=rt.device, backend="nccl", nccl_log=log)
        assert runtime.report_nccl_transport(as_nccl) == \
            "nccl transport: P2P/IPC within nodes, NET/Socket across nodes"
    finally:
        runtime.stop()
    assert "nccl transport: P2P/IPC within nodes, NET/Socket across nodes\n" in capsys.readouterr().out
