"""The user's own sbatch script: srun and torchrun inside it give one job (the template of docs/sbatch.md,
run as printed there), SIGTERM checkpoints and the rerun resumes exactly, and the dry run's script is the
one really submitted."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_helpers import run_train

from orchestrator.launch import slurm_query

pytestmark = pytest.mark.slurm

PAGE = Path(__file__).resolve().parents[2] / "docs" / "sbatch.md"
TEMPLATE_LINE = "srun --kill-on-bad-exit=1 python -m jobs.train optim.max_steps=200"
SMALL = ["data.demo_num_samples=512", "data.batch_size=16", "telemetry.enabled=false"]
# Deterministic and slow enough (transformer on 2 cores) to be signalled mid-run: the test signals at
# step 10, 50 steps before the end. One task per node (ONE_PER_NODE, given to sbatch too): the
# signal and the rerun still cross both nodes, for about 0.7x the CPU of the template's 4 ranks,
# each a new interpreter under srun (tests/conftest.py holds each rank to one OpenMP thread).
LONG = ["model=transformer", "optim.max_steps=60", "data.demo_num_samples=1024", "data.batch_size=32",
        "log_every_steps=1", "deterministic=true", "telemetry.enabled=false", "parallelism.procs_per_node=1"]
ONE_PER_NODE = "--ntasks-per-node=1"


def documented_template() -> str:
    text = PAGE.read_text()
    section = text[text.index("# Your own sbatch script"):]
    script = section[section.index("```bash\n") + 8:]
    return script[:script.index("```")]


def template_with(tmp_path: Path, *overrides: str) -> Path:
    """The documented script, its python line pointed at this interpreter with the test's overrides."""
    script = documented_template()
    assert TEMPLATE_LINE in script, "the documented template's srun line changed: update this test"
    line = f"srun --kill-on-bad-exit=1 {sys.executable} -m jobs.train " + " ".join(
        [f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.sh')))}.sh"
    path.write_text(script.replace(TEMPLATE_LINE, line))
    return path


@contextlib.contextmanager
def sbatch(script: Path, cwd: Path, *options: str) -> Iterator[str]:
    """Queue a script (output in cwd/slurm-<id>.out), ``options`` before it on sbatch's command line
    (they override its #SBATCH lines); cancelled when the test ends, pass or fail."""
    command = ["sbatch", "--parsable", f"--chdir={cwd}", f"--output={cwd}/slurm-%j.out", *options,
               str(script)]
    job_id = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    try:
        yield job_id
    finally:
        subprocess.run(["scancel", job_id], check=False)


def wait_done(job_id: str, timeout_s: float = 400) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
            return slurm_query.wait_for_terminal_states([job_id], timeout_s=60).get(job_id, "UNKNOWN")
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still queued or running after {timeout_s} s")


def test_the_documented_template_runs_one_job_of_four_ranks(tmp_path: Path) -> None:
    """Before: 4 independent 2-rank local jobs wrote one run directory, each printing a summary."""
    with sbatch(template_with(tmp_path, "optim.max_steps=20", *SMALL), tmp_path) as job_id:
        state = wait_done(job_id)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", out[-3000:]
    run_dir = tmp_path / "outputs" / "attached" / f"slurm-{job_id}-step0"  # shared by every rank
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["node_per_rank"] == ["n1", "n1", "n2", "n2"]
    assert len(set(summary["param_checksum_per_rank"])) == 1
    assert out.count("summary: ") == 1 and out.count("run_dir: ") == 1  # rank 0 alone reports
    assert not (run_dir / "submitit").exists()  # the ranks trained in place: nothing was submitted


def test_a_config_that_contradicts_the_launch_is_refused_by_rank_zero_only(tmp_path: Path) -> None:
    # one task per node: rank 1, on the other node, checks and stays silent as ranks 1-3 of four did
    script = template_with(tmp_path, "parallelism.nodes=1", "parallelism.procs_per_node=1", *SMALL)
    with sbatch(script, tmp_path, ONE_PER_NODE) as job_id:
        wait_done(job_id)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert out.count("error: parallelism.nodes=1 contradicts the launch: srun (job "
                     f"{job_id}) started 2 node(s) (try parallelism.nodes=2") == 1, out[-3000:]
    assert "Traceback" not in out and "summary: " not in out


def test_srun_of_torchrun_on_two_nodes_is_one_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "torchrun.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        f"srun --kill-on-bad-exit=1 {Path(sys.executable).parent / 'torchrun'} --nnodes=2 "
        "--nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=n1:29517 --rdzv_id=$SLURM_JOB_ID "
        f"-m jobs.train hydra.run.dir={run_dir} optim.max_steps=20 data.cache_dir={tmp_path / 'cache'} "
        + " ".join(SMALL) + "\n")
    with sbatch(script, tmp_path) as job_id:
        state = wait_done(job_id)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4
    nodes = summary["node_per_rank"]  # torchrun numbers the agents in the order they join
    assert sorted(nodes) == ["n1", "n1", "n2", "n2"] and nodes[0] == nodes[1] and nodes[2] == nodes[3]
    assert len(set(summary["param_checksum_per_rank"])) == 1


def wait_for_step(run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} never reached step {step}")


def test_sigterm_checkpoints_and_the_rerun_resumes_exactly(tmp_path: Path) -> None:
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    script = template_with(tmp_path, f"hydra.run.dir={stopped}", *LONG)
    with sbatch(script, tmp_path, ONE_PER_NODE) as job_id:
        wait_for_step(stopped, 10)
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
        wait_done(job_id)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    stop = re.search(r"stopped by PREEMPTED at step (\d+); checkpoint in", out)
    assert stop is not None, out[-3000:]
    step = int(stop.group(1))
    assert [int(c.stem.removeprefix("step-")) for c in (stopped / "checkpoints").glob("step-*.pt")] == [step]
    assert step < 60 and not (stopped / "summary.json").exists()
    with sbatch(script, tmp_path, ONE_PER_NODE) as rerun, \
            sbatch(template_with(tmp_path, f"hydra.run.dir={straight}", *LONG), tmp_path,
                   ONE_PER_NODE) as baseline:
        assert wait_done(rerun) == "COMPLETED"
        assert wait_done(baseline) == "COMPLETED"
    assert re.search(rf"resumed from {stopped / 'checkpoints'}/step-0*{step}\.pt at step {step}\n",
                     (tmp_path / f"slurm-{rerun}.out").read_text())
    resumed, uninterrupted = (json.loads((d / "summary.json").read_text()) for d in (stopped, straight))
    assert resumed["steps"] == uninterrupted["steps"] == 60
    assert resumed["param_checksum_per_rank"] == uninterrupted["param_checksum_per_rank"]


def test_the_dry_run_prints_the_script_that_is_really_submitted(tmp_path: Path, queued: list[str]) -> None:
    run_dir = tmp_path / "run"
    # cluster.wait=false: the script is what is compared, so the job is cancelled once queued
    common = ["cluster=slurm", "parallelism.nodes=2", "optim.max_steps=10", "cluster.wait=false",
              f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}",
              'cluster.sbatch_args=["--mail-type=NONE"]', *SMALL]
    dry = run_train(*common, "cluster.dry_run=true", timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "nothing was queued" in dry.stdout and not (run_dir / "submitit").exists()
    printed = dry.stdout[dry.stdout.index("#!/bin/bash"):]
    real = run_train(*common, timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
    job_id = re.search(r"slurm_job_id: (\S+)", real.stdout).group(1)  # type: ignore[union-attr]
    queued.append(job_id)
    submitted = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
    assert printed == submitted
    assert "#SBATCH --mail-type=NONE" in submitted


def test_a_dependency_holds_the_job_until_its_predecessor_ends(tmp_path: Path) -> None:
    """prepare -> train pipelines: cluster.dependency=afterok:ID reaches sbatch."""
    first = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/first-%j.out", "--wrap=sleep 300"],
                           capture_output=True, text=True, check=True).stdout.strip()
    second = None
    try:
        proc = run_train("cluster=slurm", "cluster.wait=false", f"cluster.dependency=afterok:{first}",
                         "optim.max_steps=5", *SMALL, cache_dir=tmp_path / "cache", run_dir=tmp_path / "run",
                         timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        second = re.search(r"slurm_job_id: (\S+)", proc.stdout).group(1)  # type: ignore[union-attr]
        # What holds the job is its dependency (%E), set at submission. The reason column (%r) is
        # the scheduler's latest word, and on a busy cluster it can read "Resources" until a
        # later pass writes "Dependency": CI (stop 51, four workers) saw exactly that.
        held = subprocess.run(["squeue", "-h", "-j", second, "-o", "%T %E"], capture_output=True,
                              text=True).stdout.split()
        assert held == ["PENDING", f"afterok:{first}(unfulfilled)"], held
    finally:
        subprocess.run(["scancel", first, *([second] if second else [])], check=False)
