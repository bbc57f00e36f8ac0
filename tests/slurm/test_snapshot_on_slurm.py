"""A queued job runs the code it was submitted with (orchestrator/launch/snapshot.py), on the real
local cluster. The user's model is a module in a temporary directory on PYTHONPATH, so the edits
these tests make never touch the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import run_train

from orchestrator.launch import slurm_query, snapshot

pytestmark = pytest.mark.slurm

SMALL = ["optim.max_steps=20", "data.demo_num_samples=256", "data.batch_size=16", "log_every_steps=5",
         "telemetry.enabled=false"]
MODEL = "model._target_=snapuser.models.Net"
GOOD = "from jobs.models import RowPoolingMLP\n\n\nclass Net(RowPoolingMLP):\n    pass\n"


def user_code(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "snapuser").mkdir(parents=True)
    (src / "snapuser" / "__init__.py").write_text("")
    (src / "snapuser" / "models.py").write_text(GOOD)
    return src


def train(tmp_path: Path, src: Path, *overrides: str, timeout_s: float = 300
          ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src), "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    return run_train("cluster=slurm", MODEL, *SMALL, f"cluster.snapshot.dir={tmp_path / 'store'}",
                     f"data.cache_dir={tmp_path / 'cache'}", *(o for o in overrides if o != "-m"),
                     multirun="-m" in overrides, timeout=timeout_s, env=env)


def job_id_of(proc: subprocess.CompletedProcess[str]) -> str:
    found = re.search(r"slurm_job_id: (\S+)", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-3000:]
    return found.group(1)


def test_a_pending_job_runs_the_code_it_was_submitted_with(tmp_path: Path) -> None:
    src = user_code(tmp_path)
    blocker = subprocess.run(["sbatch", "--parsable", "--wrap", "sleep 60", "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    job_id = None
    try:
        proc = train(tmp_path, src, "cluster.wait=false", f"cluster.dependency=afterany:{blocker}",
                     f"hydra.run.dir={tmp_path / 'run'}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        job_id = job_id_of(proc)
        # While it waits, the working tree breaks: a syntax error in a module the job imports.
        (src / "snapuser" / "models.py").write_text("class Net(:\n")
        subprocess.run(["scancel", blocker], check=True)  # releases the dependency
        state = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)[job_id]
        assert state == "COMPLETED", (tmp_path / "run").glob("submitit/*")
    finally:
        subprocess.run(["scancel", blocker, *([job_id] if job_id else [])], check=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 20
    record = json.loads((tmp_path / "run" / "provenance.json").read_text())
    snap = Path(record["snapshot"]["path"])
    assert snap.parent == tmp_path / "store"
    assert (snap / "snapuser" / "models.py").read_text() == GOOD
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "submitit").glob("*_log.out"))
    assert f"switchyard: code snapshot {record['snapshot']['hash'][:16]} ({snap})" in logs  # every rank
    assert "warning" not in logs.split("code snapshot", 1)[0][-200:]
    show = subprocess.run([str(Path(sys.executable).parent / "switchyard"), "show", job_id,
                           "--registry", str(tmp_path / "registry.db")],
                          capture_output=True, text=True, timeout=60)
    named = f"code snapshot: {record['snapshot']['hash'][:16]} ({snap})"
    assert named in show.stdout, show.stdout + show.stderr
    assert "git: " in show.stdout


def test_a_job_whose_snapshot_was_deleted_while_pending_stops_naming_it(tmp_path: Path,
                                                                      queued: list[str]) -> None:
    """The issue: it ran the working tree (the job's directory ends PYTHONPATH), warned only that
    "something on PYTHONPATH comes before it", and its checkpoints named the deleted snapshot."""
    src = user_code(tmp_path)
    marker = tmp_path / "working-tree-imported"
    blocker = subprocess.run(["sbatch", "--parsable", "--wrap", "sleep 300", "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    queued.append(blocker)
    proc = train(tmp_path, src, "cluster.wait=false", f"cluster.dependency=afterany:{blocker}",
                 f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = job_id_of(proc)
    queued.append(job_id)
    record = json.loads((tmp_path / "run" / "provenance.json").read_text())
    snap = Path(record["snapshot"]["path"])
    shutil.rmtree(snap)  # while the job waits: `switchyard snapshots prune`, or by hand
    (src / "snapuser" / "models.py").write_text(f"open({str(marker)!r}, 'w').close()\n{GOOD}")
    subprocess.run(["scancel", blocker], check=True)  # releases the dependency
    state = slurm_query.wait_for_terminal_states([job_id], timeout_s=300)[job_id]
    assert state == "FAILED"
    err = "".join(p.read_text() for p in (tmp_path / "run" / "submitit").glob(f"{job_id}_*_log.err"))
    assert err == (f"error: the code snapshot {snap} of this job is missing: it was deleted after the "
                   f"job was submitted, so the job stops before running your code. Resubmit the job (a "
                   f"new snapshot is taken), or submit with cluster.snapshot.enabled=false to run the "
                   f"working tree\n"), err
    assert not marker.exists() and not (tmp_path / "run" / "summary.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_sweep_stores_one_snapshot_and_every_point_names_it(tmp_path: Path) -> None:
    src = user_code(tmp_path)
    proc = train(tmp_path, src, "-m", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                 timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored = list((tmp_path / "store").iterdir())
    assert len(stored) == 1, stored
    points = list((tmp_path / "sweep").glob("*/provenance.json"))
    assert len(points) == 2
    hashes = {json.loads(p.read_text())["snapshot"]["hash"] for p in points}
    assert hashes == {stored[0].name}
    again = train(tmp_path, src, "-m", "optim.lr=3e-3", "cluster.wait=false",
                  f"hydra.sweep.dir={tmp_path / 'sweep2'}")
    assert again.returncode == 0, again.stderr[-3000:]
    now = sorted((tmp_path / "store").iterdir())
    if len(now) > 1:  # the shared checkout was edited between the two submissions (others work in it)
        later = next(p for p in now if p != stored[0])
        changed = snapshot.changed_files(snapshot.read_manifest(stored[0]) or {},
                                         snapshot.read_manifest(later) or {})
        assert changed and not [f for f in changed if f.startswith("snapuser/")], changed
    else:
        assert [p.name for p in now] == [stored[0].name]  # nothing new stored
    for line in re.findall(r"submitted in \d+ submission\(s\): (\S+)", again.stdout + again.stderr):
        subprocess.run(["scancel", line], check=False)


def test_a_resume_under_edited_model_code_is_refused_unless_allowed(tmp_path: Path) -> None:
    src = user_code(tmp_path)
    run = f"hydra.run.dir={tmp_path / 'run'}"
    first = train(tmp_path, src, run, "checkpoint.every_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    (src / "snapuser" / "models.py").write_text(GOOD + "# tuned\n")
    refused = train(tmp_path, src, run, "optim.max_steps=30")
    assert refused.returncode != 0
    assert "written under other code" in refused.stderr and "snapuser/models.py" in refused.stderr, \
        refused.stderr[-3000:]
    allowed = train(tmp_path, src, run, "optim.max_steps=30", "checkpoint.allow_code_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["resumed_from"]["step"] == 20
    # in: the checkout's own files may change meanwhile too (others edit it), and are named alike
    assert "snapuser/models.py" in summary["resumed_from"]["code_change"]["files"]
    assert "resumed under other code" in allowed.stderr
