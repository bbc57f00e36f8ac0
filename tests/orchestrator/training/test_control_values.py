"""Control values work on a process group whose device backend accepts only device tensors, as NCCL.

On a GPU run the group's backend is NCCL, which moves only CUDA tensors: an all_reduce of a CPU
tensor fails with "No backend type associated with device type cpu" (that crashed every GPU job at
step 1). CI has no NCCL, so a stand-in is registered for CUDA tensors only, exactly as NCCL is, and
two real processes run every collective the trainer issues besides DDP's own: the asynchronous
stop-flag poll, the reduced metrics, the start-up agreement, gathers, broadcasts and barriers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

RANK_SCRIPT = r"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

def device_only(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)

# A stand-in for NCCL: a backend for CUDA tensors only. A CPU tensor sent to a group that has no
# CPU backend beside it fails as on a GPU node.
dist.Backend.register_backend("devonly", device_only, devices=["cuda"])

from orchestrator.launch import dist_env, rendezvous
from orchestrator.config import LoggerConfig
from orchestrator.training import metrics, preemption, runtime
from orchestrator.training.run_log import RunLog

run_dir = Path(sys.argv[1])
env = dist_env.detect()
backend = rendezvous.init_process_group(env, run_dir / "rdzv", backend="devonly")
rt = runtime.Runtime(env=env, device=torch.device("cpu"), backend=backend)
flag = preemption.StopFlag()
if env.rank == 1:
    flag.request(preemption.StopReason.PREEMPTED)
stops = preemption.StopPoll(flag)
decided = [stops.poll() for _ in range(3)]
stops.drain()
log = RunLog(LoggerConfig(tensorboard=False), run_dir, 0, {}) if env.rank == 0 else None
window = metrics.MetricsWindow(rt, log)  # its peak memory is a host value reduced beside the device
window.add(torch.tensor([3.0 * (env.rank + 1), 3.0, 3.0], dtype=torch.float64))
loss, _ = window.close(step=1, lr=0.1, grad_norm=None)
totals = runtime.global_sums(rt, torch.tensor([1.0, float(env.rank)], dtype=torch.float64))
runtime.agree(rt, batches_per_epoch=7)
ranks = runtime.gather(rt, env.rank)
chosen = runtime.broadcast(rt, "checkpoint-from-rank-0" if env.rank == 0 else None)
dist.barrier()
print(f"backend={backend} decided={[d.name for d in decided]} loss={loss} ranks={ranks} chosen={chosen} "
      f"totals={totals}")
rendezvous.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_control_collective_works_beside_a_device_only_backend(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        # the flag of rank 1 reached rank 0 one poll later; the mean is (3 + 6) / (3 + 3)
        assert ("backend=devonly decided=['NONE', 'PREEMPTED', 'PREEMPTED'] loss=1.5 ranks=[0, 1] "
                "chosen=checkpoint-from-rank-0 totals=[2.0, 1.0]") in out
