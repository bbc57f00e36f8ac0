"""Rank 0 says it requeues the job before it asks SLURM to: SLURM stops every rank as soon as the
requeue is taken, SIGKILL coming KillWait seconds after SIGTERM (5 s on the local cluster). A rank
that printed "requeued job N" after ``scontrol requeue`` returned lost the line on a loaded node:
the suite's signal test found the job requeued, resumed and COMPLETED, and no such line in the log.

Here ``scontrol`` is a script that does what SLURM does once the requeue is taken, at once: it
SIGKILLs the rank that called it. The line must already be out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = ("DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=2, node_rank=0, num_nodes=2, "
       "master_addr='n1', hostname='n1', job_id='77', restart_count=0, source='slurm')")

TRAINER = f"""
from pathlib import Path
from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import preemption
preemption.leave(preemption.StopReason.TIME_LIMIT, {ENV}, 3, 12, Path('ckpt'), Path('run'))
"""

COMMAND = f"""
from pathlib import Path
from orchestrator.launch.dist_env import DistEnv
from orchestrator.scripts import rank
spec = rank.CommandSpec(argv=['true'], cwd='.', gpus_per_node=0, max_requeues=3, signal_delay_s=60,
                        rendezvous_timeout_s=60)
rank._requeue_or_fail(rank.RankResult(0, 'n1', 75, 1.0), spec, {ENV}, Path('run'))
"""


@pytest.mark.parametrize(("code", "line"), [
    (TRAINER, "requeueing job 77 at step 12 (1/3 requeues)"),
    (COMMAND, "switchyard: requeueing job 77: the command asked to be requeued (1/3 requeues)"),
], ids=["jobs.train", "switchyard run"])
def test_the_requeue_line_is_out_before_slurm_stops_the_rank(tmp_path: Path, code: str, line: str) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/bash\necho "$@" > {tmp_path / "asked"}\nkill -KILL $PPID\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert (tmp_path / "asked").read_text().split() == ["requeue", "77"], proc.stderr[-2000:]
    assert proc.returncode == -9
    assert line in proc.stdout.splitlines(), proc.stdout
