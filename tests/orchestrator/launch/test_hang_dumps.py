"""Where each rank was when a collective hung (``orchestrator/launch/hang_dumps.py``): the report
from the dumps, the dumps themselves from real gloo ranks, and a whole local job whose rank 1 is
alive elsewhere while rank 0 waits."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_helpers import rank_processes
from train_helpers import CHEAP, run_train

from orchestrator.launch import hang_dumps, rendezvous
from orchestrator.launch.dist_env import DistEnv
from orchestrator.launch.hang_dumps import Collective, Dumper, RankDump

TESTS = str(Path(__file__).resolve().parents[2])  # model_helpers, for the ranks


def dump(rank: int, seq: int, op: str = "gloo:allreduce", frames: tuple[str, ...] = ("a.py:1 in f",)
         ) -> RankDump:
    return RankDump(rank=rank, node=f"n{rank // 2 + 1}", pid=100 + rank, step=7, phase="compute",
                    reason="test", stacks={"MainThread": list(frames)},
                    collectives=[Collective("0", s, op, "scheduled") for s in range(seq - 2, seq + 1)])


def test_the_rank_behind_in_collectives_is_named_with_its_stack() -> None:
    dumps = [dump(0, 1205), dump(1, 1205), dump(2, 1205),
             dump(3, 1204, frames=("train.py:9 in step", "loader.py:40 in __next__"))]
    found = hang_dumps.report(dumps, 4)
    assert found is not None and found.ranks == [3]
    assert found.summary.startswith("rank 3 (n2) last entered allreduce #1204 (step 7, compute); "
                                    "ranks 0-2 entered allreduce #1205; rank 3's stack: "
                                    "loader.py:40 in __next__ <- train.py:9 in step")
    assert len(found.lines) == 4 and "last entered allreduce #1204" in found.lines[3]


def test_one_sequence_number_with_different_ops_names_the_odd_rank() -> None:
    found = hang_dumps.report([dump(0, 15), dump(1, 15, op="gloo:broadcast"), dump(2, 15)], 3)
    assert found is not None and found.ranks == [1]
    assert "rank 1 (n1) last entered broadcast #15" in found.summary
    assert "where ranks 0, 2 entered allreduce #15 (a collective skipped or called in another order)" \
        in found.summary


def test_ranks_at_one_collective_name_nobody_and_a_silent_rank_is_said() -> None:
    found = hang_dumps.report([dump(0, 15), dump(1, 15)], 3)
    assert found is not None and found.ranks == []
    assert found.summary == "rank 2 left no dump (a frozen process cannot)"
    assert hang_dumps.report([], 2) is None


def test_a_rank_dumps_once_asked_and_a_previous_attempts_request_is_cleared(tmp_path: Path) -> None:
    dumper = Dumper(tmp_path, rank=1, world_size=2, node="n1")
    dumper.poll(3, "data")
    assert not hang_dumps.hang_dir(tmp_path).exists()  # nothing asked: nothing written
    Dumper(tmp_path, rank=0, world_size=2, node="n1").on_timeout(
        3, "compute", RuntimeError("Timed out waiting 6000ms"), wait_s=0)
    dumper.poll(3, "data")
    [_, mine] = hang_dumps.read_dumps(tmp_path)
    assert (mine.rank, mine.step, mine.phase, mine.reason) == (1, 3, "data", "rank 0's collective timed out")
    assert any("test_a_rank_dumps_once_asked" in frame for frame in mine.stacks["MainThread"])
    hang_dumps.clear(tmp_path)
    assert not hang_dumps.hang_dir(tmp_path).exists()


def test_the_recorder_is_the_users_to_size(monkeypatch: object, tmp_path: Path) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "7"  # the suite's autouse fixture restores the environment
    wanted = hang_dumps.recorder_environment(tmp_path)
    assert "TORCH_FR_BUFFER_SIZE" not in wanted and wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def _recording_rank(rank: int, rdzv: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(hang_dumps.recorder_environment(Path(rdzv)))
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", hostname="localhost", job_id="j", restart_count=0, source="local")
    rendezvous.init_process_group(env, Path(rdzv), backend="gloo", rendezvous_timeout_s=30)
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    out.put((rank, [(c.seq, c.op) for c in hang_dumps.recorded_collectives()]))
    rendezvous.destroy_process_group()


def test_gloo_ranks_record_their_collectives_by_sequence_number(tmp_path: Path) -> None:
    ctx = rank_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_recording_rank, args=(r, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    found = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert found[0] == found[1] and found[0][-2:] == [(found[0][-2][0], "gloo:all_reduce"),
                                                       (found[0][-2][0] + 1, "gloo:broadcast")]


def test_a_rank_that_skipped_a_collective_is_named_where_it_was(tmp_path: Path) -> None:
    """Before: both ranks beat on at the same step, and the report said 'cannot tell which rank
    hung'. Rank 1 enters a broadcast that rank 0, in the gradients' all-reduce, never calls."""
    run_dir = tmp_path / "run"
    proc = run_train("optim.max_steps=1000", "data.demo_num_samples=512", "data.batch_size=16", *CHEAP,
                     "cluster.collective_timeout_s=4", "model=custom",
                     "model._target_=model_helpers.SkipsACollectiveOnRank1", cache_dir=tmp_path / "cache",
                     run_dir=run_dir, timeout=300,
                     env={"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("error: job"):]
    assert "collective timeout: rank 1 (" in report and "last entered broadcast #" in report, report
    assert "where rank 0 entered all_reduce #" in report and "model_helpers.py" in report
    culprits = [line for line in report.splitlines() if line.startswith("rank ")]
    assert culprits and culprits[0].startswith("rank 1 "), report
    kept = json.loads((run_dir / "summary.json").read_text())["hang"]
    assert kept["ranks"] == [1] and len(kept["lines"]) == 2
    ref = re.search(r"^job: (\S+)", proc.stdout, re.M).group(1)  # type: ignore[union-attr]
    show = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", ref],
                          capture_output=True, text=True, timeout=60)
    assert "where each rank was" in show.stdout and "last entered broadcast #" in show.stdout, show.stderr
