"""`switchyard show` of a failed sweep job names the rank that failed first and quotes its error,
as a single job's report does (issue 27: it showed rank 0's "Connection closed by peer", the
consequence of rank 1's failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

# Rank 1 raises while rank 0 waits for it in a collective.
RANK_1_RAISES = textwrap.dedent("""
    import os
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 diverged at step 7")
    dist.barrier()
""")


def test_show_names_the_rank_that_failed_first(tmp_path: Path, queued: list[str]) -> None:
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}

    def switchyard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    (tmp_path / "train.py").write_text(RANK_1_RAISES)
    switchyard("run", "-m", "cluster=slurm", "parallelism.nodes=2", "parallelism.procs_per_node=1",
               "+x=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", "--", sys.executable, "train.py")
    listed = json.loads(switchyard("status", "1", "--json").stdout)
    queued += [j["slurm_id"] for j in listed["jobs"] if j["slurm_id"]]
    assert [j["state"] for j in listed["jobs"]] == ["FAILED"], listed
    show = switchyard("show", "1/0")
    assert show.returncode == 0, show.stderr
    report = show.stdout[show.stdout.index("why try 1 failed"):]
    culprit = next(line for line in report.splitlines() if line.startswith("rank "))
    assert culprit.startswith("rank 1 on node "), report
    assert "ValueError: rank 1 diverged at step 7" in report
    assert json.loads(switchyard("show", "1/0", "--json").stdout)["failure"].startswith("job ")
