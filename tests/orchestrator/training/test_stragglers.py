"""Slow ranks named before they become hangs (``orchestrator/training/stragglers.py``): the rule
that flags a rank, what a flag feeds (the bad-node rules), and a real local job whose rank 1 reads
its batches late."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from train_helpers import CHEAP, run_train

from orchestrator.launch import bad_nodes
from orchestrator.training.stragglers import Lateness

TESTS = str(Path(__file__).resolve().parents[2])  # model_helpers and task_helpers, for the ranks


def lateness(tmp_path: Path, world: int = 3) -> Lateness:
    rt = SimpleNamespace(env=SimpleNamespace(world_size=world, hostname="n1"), is_main=True)
    found = Lateness(rt, tmp_path, fraction=0.25, windows=3)  # type: ignore[arg-type]
    found.nodes = ["n1", "n1", "n2"][:world]
    return found


def test_a_rank_late_three_windows_in_a_row_is_flagged_once(tmp_path: Path,
                                                             capsys: object) -> None:
    found = lateness(tmp_path)
    for late in (0.5, 0.0, 0.5, 0.5):  # a window in time breaks the streak
        found.note(2, late, step_s=1.0)
    assert found.flagged == {}
    found.note(2, 0.7, step_s=1.0)
    found.note(2, 0.9, step_s=1.0)  # already flagged: not again
    [flag] = found.flagged.values()
    assert (flag.rank, flag.node, flag.median_late_s, flag.share_of_step, flag.windows) == \
        (2, "n2", 0.5, 0.5, 3)
    assert json.loads((tmp_path / bad_nodes.STRAGGLERS_FILE).read_text())[0]["rank"] == 2


def test_lateness_under_the_share_or_the_noise_floor_flags_nobody(tmp_path: Path) -> None:
    found = lateness(tmp_path)
    for _ in range(5):
        found.note(1, 0.2, step_s=1.0)  # 20 % of a step: under 25 %
        found.note(2, 0.004, step_s=0.01)  # 40 % of a tiny step, but under the noise floor
    assert found.flagged == {}


def test_a_flagged_rank_blames_its_node_only_where_nothing_stronger_does() -> None:
    line = ("switchyard: slow rank 1 on node n2: it enters the gradient reduction 0.150 s after the "
            "earliest rank (96% of a step, 3 logging windows in a row): its data path or its node is slow")
    found = bad_nodes.from_logs("FAILED", ["n1", "n2"], "", {0: ("n1", line), 1: ("n2", "")})
    assert [(b.node, b.why) for b in found] == [
        ("n2", "rank 1 was persistently slow there: it entered the gradient reduction 0.150 s after the "
               "others")]
    killed = "srun: error: n1: task 0: Killed\n"
    assert [b.node for b in bad_nodes.from_logs("FAILED", ["n1", "n2"], killed, {0: ("n1", line)})] == ["n1"]


def test_a_rank_whose_data_path_is_slow_is_named_in_the_summary_and_show(tmp_path: Path) -> None:
    """Before: nothing said so; DDP's all-reduce evened the ranks' step times out."""
    run_dir = tmp_path / "run"
    proc = run_train("optim.max_steps=40", "data.demo_num_samples=512", "data.batch_size=16", *CHEAP,
                     "log_every_steps=8", "task=custom", "task._target_=task_helpers.SlowOnRank1Classify",
                     cache_dir=tmp_path / "cache", run_dir=run_dir, timeout=300,
                     env={"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: slow rank 1 on node " in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    [flag] = summary["stragglers"]
    assert flag["rank"] == 1 and flag["median_late_s"] > 0.1
    fast, slow = summary["lateness_per_rank_s"]
    assert fast == 0.0 and slow > 0.1
    ref = re.search(r"^job: (\S+)", proc.stdout, re.M).group(1)  # type: ignore[union-attr]
    show = subprocess.run([sys.executable, "-m", "orchestrator.cli", "show", ref],
                          capture_output=True, text=True, timeout=60)
    assert "slow rank 1 on node" in show.stdout, show.stderr
