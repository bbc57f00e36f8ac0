"""torchrun's variables on the ranks of a SLURM ``jobs.train`` job, forked by the node launcher on 2
nodes x 2 ranks (issue 53, item 7; the local twin is tests/jobs/test_rank_environment.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from train_helpers import CHEAP, run_train

pytestmark = pytest.mark.slurm

RECORDING_MODEL = '''
import json
import os
from pathlib import Path

from jobs.models import RowPoolingMLP

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Net(RowPoolingMLP):
    """The built-in MLP, writing the torchrun variables it sees as it is built on a rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "SLURM_PROCID" in os.environ:  # a rank, not the submitter's check
            seen = {k: os.environ.get(k) for k in KEYS}
            Path(os.environ["RECORD_DIR"], os.environ["SLURM_PROCID"] + ".json").write_text(json.dumps(seen))
'''


def test_a_forked_slurm_rank_has_torchruns_variables(tmp_path: Path) -> None:
    src, record, run_dir = tmp_path / "src", tmp_path / "seen", tmp_path / "run"
    (src / "envrecord").mkdir(parents=True)
    (src / "envrecord" / "__init__.py").write_text("")
    (src / "envrecord" / "models.py").write_text(RECORDING_MODEL)
    record.mkdir()
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p)
    proc = run_train(*CHEAP, "cluster=slurm", "parallelism.nodes=2", "model=custom",
                     "model._target_=envrecord.models.Net", "optim.max_steps=2", "data.demo_num_samples=128",
                     "data.batch_size=16", f"cluster.snapshot.dir={tmp_path / 'store'}",
                     cache_dir=tmp_path / "cache", run_dir=run_dir, timeout=400,
                     env={"PYTHONPATH": path, "RECORD_DIR": str(record),
                          "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((run_dir / "submitit").glob("*_log.out"))
    assert len(logs) == 4 and all("forked from the node launcher" in log.read_text() for log in logs)
    endpoint = json.loads(next((run_dir / "rendezvous").glob("rdzv-*.json")).read_text())
    seen = [json.loads((record / f"{rank}.json").read_text()) for rank in range(4)]
    assert seen == [{"RANK": str(r), "LOCAL_RANK": str(r % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": endpoint["host"], "MASTER_PORT": str(endpoint["port"])} for r in range(4)]
    assert endpoint["host"] == "n1"  # the first node of the job's two: rank 0's
