"""What a user's model sees on a rank of ``jobs.train``: torchrun's variables, as a torchrun worker
would (issue 53, item 7). A real run with a model that records ``os.environ`` on each rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from train_helpers import CHEAP, run_train

from orchestrator.launch import rank_env, rendezvous
from orchestrator.launch.dist_env import EXPORTED_ENV, DistEnv, detect

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

RECORDING_MODEL = '''
import json
import os
from pathlib import Path

from jobs.models import RowPoolingMLP

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Net(RowPoolingMLP):
    """The built-in MLP, writing the torchrun variables it sees as it is built on a rank, one file
    per rank (the submitter builds one too, to check it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "SUBMITIT_LOCAL_GLOBALID" in os.environ:
            seen = {k: os.environ.get(k) for k in KEYS}
            rank = os.environ["SUBMITIT_LOCAL_GLOBALID"]
            Path(os.environ["RECORD_DIR"], f"{rank}.json").write_text(json.dumps(seen))
'''


def test_a_forked_rank_of_a_local_run_has_torchruns_variables(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "recording.py").write_text(RECORDING_MODEL)
    record = tmp_path / "seen"
    record.mkdir()
    paths = [str(tmp_path), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    run_dir = tmp_path / "run"
    proc = run_train(*CHEAP, "model=custom", "model._target_=recording.Net", "optim.max_steps=2",
                     "data.demo_num_samples=128", "data.batch_size=16",
                     cache_dir=tmp_path.parent / "demo-cache", run_dir=run_dir,
                     env={"RECORD_DIR": str(record)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((run_dir / "submitit").glob("*_log.out"))
    assert all("rank process forked from" in log.read_text() for log in logs), "the ranks were not forked"
    seen = [json.loads((record / f"{rank}.json").read_text()) for rank in (0, 1)]
    endpoint = json.loads(next((run_dir / "rendezvous").glob("rdzv-*.json")).read_text())
    assert seen == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": endpoint["host"], "MASTER_PORT": str(endpoint["port"])} for r in (0, 1)]


def slurm_rank(rank: int) -> dict[str, str]:
    return {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2),
            "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": str(rank // 2), "SLURM_JOB_ID": "77"}


def test_exported_variables_describe_the_rank_and_leave_the_launcher_detected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On SLURM, a rank's own exported RANK/WORLD_SIZE are not a torchrun launch: ``detect`` still
    reads SLURM's (job id, node), and the variables go as they came once the rank ends."""
    for key, value in slurm_rank(3).items():
        monkeypatch.setenv(key, value)
    for key in (*TORCHRUN_KEYS, EXPORTED_ENV):
        monkeypatch.delenv(key, raising=False)
    env = detect()
    rendezvous.publish(rendezvous.endpoint_file(tmp_path, env), rendezvous.Endpoint("n1", 41234))
    with rank_env.exported(env, tmp_path):
        assert {k: os.environ[k] for k in TORCHRUN_KEYS} == {
            "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1", "MASTER_PORT": "41234"}
        assert detect() == env and detect().source == "slurm"
    assert not any(k in os.environ for k in (*TORCHRUN_KEYS, EXPORTED_ENV))


def test_a_real_torchrun_launch_keeps_its_own_variables(tmp_path: Path) -> None:
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                  master_addr="h", hostname="h", job_id="t", restart_count=0, source="torchrun",
                  master_port=29500)
    before = dict(os.environ)
    with rank_env.exported(env, tmp_path):  # no endpoint file: torchrun's are already there
        assert dict(os.environ) == before
