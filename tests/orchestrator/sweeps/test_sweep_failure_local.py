"""A blocking sweep whose rank 1 fails first ends naming rank 1 and quoting its error, as a single
job's report does (issue 27: the Hydra traceback showed rank 0's "Connection closed by peer", the
consequence, because the launcher preferred rank 0's own saved JobReturn)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from train_helpers import run_train

RANK_1_FAILS = '''
import torch.distributed as dist

from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """The built-in MLP, whose rank 1 raises at its 3rd forward pass while rank 0 goes on."""

    calls = 0

    def forward(self, *args, **kwargs):
        Net.calls += 1
        if Net.calls == 3 and dist.get_rank() == 1:
            raise ValueError("rank 1 diverged at step 3")
        return super().forward(*args, **kwargs)
'''


def test_a_blocking_sweep_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    (tmp_path / "rank1fails.py").write_text(RANK_1_FAILS)
    paths = [str(tmp_path), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = run_train("cluster=local", "parallelism.procs_per_node=2", "model=custom",
                     "model._target_=rank1fails.Net", "optim.max_steps=20", "seed=1",
                     "data.demo_num_samples=256", cache_dir=tmp_path / "cache", sweep_dir=tmp_path / "sweep",
                     multirun=True, env=env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "JobFailedError: " in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.rindex("JobFailedError: "):]  # what the sweep ended with
    culprit = next(line for line in error.splitlines() if line.startswith("rank "))
    assert culprit.startswith("rank 1 on node "), error
    assert "ValueError: rank 1 diverged at step 3" in error


RANK_1_RAISES = """
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank 1 diverged at step 7")
dist.barrier()
"""


def test_a_command_sweep_names_the_rank_whose_log_is_not_a_lost_peer(tmp_path: Path) -> None:
    """`switchyard run -m`: each rank's command exits, so no rank leaves a result, only its log;
    rank 0's log ends in "Connection closed by peer" and was named first."""
    (tmp_path / "train.py").write_text(RANK_1_RAISES)
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", "-m", "cluster=local",
         "parallelism.procs_per_node=2", "+x=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", "--",
         sys.executable, str(tmp_path / "train.py")],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "JobFailedError: " in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.rindex("JobFailedError: "):]
    culprits = [line for line in error.splitlines() if line.startswith("rank ")]
    assert len(culprits) == 1 and culprits[0].startswith("rank 1 on node "), error
    assert "ValueError: rank 1 diverged at step 7" in error
