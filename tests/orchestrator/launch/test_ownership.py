"""A run directory belongs to one run (``orchestrator.launch.ownership``): unique defaults, a live
run's directory refused to a second submission before it is submitted, the user's own files never
written over, a sweep's points never sharing one directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import CHEAP, run_train

from orchestrator.config import ConfigError
from orchestrator.launch import ownership, run_lock
from orchestrator.registry.db import SINGLE_ENTRY, SINGLE_NUM, Job, Registry, Submitted

THIS = ownership.Claimant("train optim.lr=0.2")

# Two submissions in one instant: the clock frozen at one microsecond in every process.
FROZEN_CLOCK = """
import datetime, runpy, sys
import hydra.core.utils

class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5, 678901)

hydra.core.utils.datetime = Frozen  # what Hydra's ${now:} reads
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def resolved_dirs(stdout: str) -> tuple[str, str]:
    """``--cfg hydra --resolve``'s run and sweep directories."""
    lines = stdout.splitlines()
    run = lines[lines.index("  run:") + 1].split("dir: ")[1]
    sweep = lines[lines.index("  sweep:") + 1].split("dir: ")[1]
    return run, sweep


@pytest.mark.parametrize("command", [["jobs.train"], ["orchestrator.cli", "run"]])
def test_submissions_in_one_instant_get_their_own_run_and_sweep_directories(
        tmp_path: Path, command: list[str]) -> None:
    """Before, runs submitted in the same second shared outputs/DATE/HH-MM-SS (a shell loop of
    cluster.wait=false submissions): the second resumed the first's checkpoint or failed after its
    queue wait. Three processes at one frozen microsecond: three directories of each kind."""
    (tmp_path / "frozen.py").write_text(FROZEN_CLOCK)
    tail = ["--", "true"] if command[-1] == "run" else []
    procs = [subprocess.Popen([sys.executable, "frozen.py", *command, "--cfg", "hydra", "--resolve", *tail],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    dirs = [resolved_dirs(out) for out, _ in outputs]
    assert all("2026-01-02/03-04-05-678901" in run and "2026-01-02/03-04-05-678901" in sweep
               for run, sweep in dirs), dirs
    assert len({run for run, _ in dirs}) == 3, f"one run directory for three submissions: {dirs}"
    assert len({sweep for _, sweep in dirs}) == 3, f"one sweep directory for three submissions: {dirs}"


# ------------------------------------------------------------------------------------------------
# What a directory may hold


def test_a_new_an_empty_or_a_hydra_only_directory_is_accepted(tmp_path: Path) -> None:
    ownership.check(tmp_path / "new", THIS)
    ownership.check(tmp_path, THIS)
    (tmp_path / ".hydra").mkdir()  # a dry run, or a run refused by a later check, leaves these
    (tmp_path / "train.log").write_text("")
    (tmp_path / "signal_delay.json").write_text("{}")  # a SLURM point prepared before another was refused
    ownership.check(tmp_path, THIS, hydra_log="train.log")


def test_a_directory_of_the_users_own_files_is_refused_naming_them(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"hydra.run.dir='.*' holds files that are not a Switchyard run's: "
                                          r"metrics.jsonl, summary.json; .*nothing was submitted \(try "
                                          r"hydra.run.dir=<a new or empty directory>\)"):
        ownership.check(tmp_path, THIS)


def test_the_file_system_root_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"hydra.run.dir='/' holds files that are not a Switchyard run's"):
        ownership.check(Path("/"), THIS)


def test_an_empty_path_is_refused_with_a_fix() -> None:
    with pytest.raises(ConfigError, match=r"hydra.run.dir='' is invalid: an empty path is the working "
                                          r"directory.*\(try hydra.run.dir=<a new directory>"):
        ownership.check_path("", "hydra.run.dir")


@pytest.mark.parametrize("marker", [ownership.MARKER, ".switchyard/config.yaml", run_lock.LOCK_NAME])
def test_a_switchyard_runs_own_directory_no_live_run_holds_is_accepted(tmp_path: Path, marker: str) -> None:
    """Continuing a stopped or finished run with the same hydra.run.dir, as docs/preemption.md says;
    runs from before the marker count by their older files."""
    (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / marker).write_text("{}")
    (tmp_path / "summary.json").write_text("{}")
    ownership.check(tmp_path, THIS)
    ownership.claim(tmp_path, THIS)


# ------------------------------------------------------------------------------------------------
# A live run's directory


CLAIM_AND_WAIT = """
import sys, time
from pathlib import Path
from orchestrator.launch import ownership
ownership.claim(Path(sys.argv[1]), ownership.Claimant("train optim.lr=0.1"))
print("claimed", flush=True)
time.sleep(300)
"""


def test_a_submission_still_at_work_holds_its_directory(tmp_path: Path) -> None:
    """Two submissions naming one directory at once: the second sees the first's claim (its
    process alive, its job not yet recorded) and is refused, naming both."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", CLAIM_AND_WAIT, str(run_dir)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "claimed"
        with pytest.raises(ownership.RunDirInUseError,
                           match=rf"is in use by a submission still at work, `train optim.lr=0.1` .*by pid "
                                 rf"{first.pid} .*this run, `train optim.lr=0.2`"):
            ownership.claim(run_dir, THIS)
    finally:
        first.kill()
        first.wait()
    ownership.claim(run_dir, THIS)  # its submitter gone, nothing recorded: the directory is free


def test_a_recorded_job_holds_its_directory_until_it_ends(tmp_path: Path) -> None:
    """A queued job holds no lock (rank 0 takes it when it starts): the registry the marker names
    says the job is live. Here a local job's process, recorded as the submitting side records it."""
    run_dir, registry_path = tmp_path / "run", tmp_path / "registry.db"
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        ownership.claim(run_dir, ownership.Claimant("train optim.lr=0.1"))
        with Registry(registry_path) as registry:
            sweep_id = registry.create_sweep(app="train", command="optim.lr=0.1", sweep_dir=str(run_dir),
                                             executor="local", entry_path=SINGLE_ENTRY)
            registry.add_jobs([Job(sweep_id, SINGLE_NUM, ["optim.lr=0.1"], str(run_dir), {}, None)])
            attempt = registry.claim(sweep_id, [SINGLE_NUM])[SINGLE_NUM]
            registry.confirm([Submitted(attempt, str(job.pid), None, None, str(run_dir / "submitit"))])
        ownership.record_job(run_dir, registry_path, sweep_id, SINGLE_NUM, str(job.pid))
        with pytest.raises(ownership.RunDirInUseError,
                           match=rf"is in use by switchyard job {sweep_id}/{SINGLE_NUM} \(id {job.pid}, "
                                 rf"[A-Z]+, submitted as `train optim.lr=0.1`\); this run, "
                                 rf"`train optim.lr=0.2`"):
            ownership.check(run_dir, THIS)
    finally:
        job.kill()
        job.wait()
    deadline = time.monotonic() + 60
    while ownership.live_owner(run_dir) is not None and time.monotonic() < deadline:
        time.sleep(0.5)  # the registry learns the process is gone
    ownership.check(run_dir, THIS)


def test_points_sharing_one_directory_are_refused_naming_them(tmp_path: Path) -> None:
    dirs = ownership.SweepDirs(THIS)
    dirs.check("sweep point #0 (optim.lr=0.1)", tmp_path / "same")
    with pytest.raises(ConfigError, match=r"its run directory '.*/same' is sweep point #0 \(optim.lr=0.1\)'s "
                                          r"too: each point needs its own"):
        dirs.check("sweep point #1 (optim.lr=0.2)", tmp_path / "same")
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"hydra.sweep.subdir=.* notes.txt"):
        dirs.check("sweep point #2 (optim.lr=0.3)", tmp_path / "2")


# ------------------------------------------------------------------------------------------------
# The entry points


def test_jobs_train_refuses_a_directory_of_the_users_files_and_leaves_them(tmp_path: Path) -> None:
    """Before, hydra.run.dir=DIR of the user's own summary.json and metrics.jsonl replaced both,
    rc 0. Now one error line, before Hydra writes anything there."""
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text('{"mine": 1}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = run_train(*CHEAP, "optim.max_steps=2", run_dir=run_dir, cache_dir=tmp_path / "cache", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"error: hydra.run.dir='{run_dir}' holds files that are not a Switchyard run's: metrics.jsonl, "
        f"summary.json; the run would write its summary.json, metrics.jsonl, checkpoints/ and logs there, "
        f"over any of the same name, so nothing was submitted (try hydra.run.dir=<a new or empty directory>)"]
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "summary.json"]
    assert (run_dir / "summary.json").read_text() == '{"mine": 1}'


@pytest.mark.parametrize("override", ["hydra.run.dir=", "data.cache_dir="])
def test_jobs_train_refuses_an_empty_path_before_writing_in_the_working_directory(
        tmp_path: Path, override: str) -> None:
    proc = run_train(*CHEAP, "optim.max_steps=2", override, cwd=tmp_path)
    key = override.rstrip("=")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {key}='' is invalid: an empty path is the working directory")
    assert f"(try {key}=" in proc.stderr
    assert not {".hydra", "train.log", "summary.json"} & set(os.listdir(tmp_path)), os.listdir(tmp_path)


@pytest.mark.parametrize("subdir", ["same", "${seed}"])
def test_a_sweep_whose_points_share_a_directory_is_refused_before_anything_is_submitted(
        tmp_path: Path, subdir: str) -> None:
    """Before, point #0 trained with point #1's config: the per-point config in the shared
    directory was overwritten at submission."""
    sweep_dir = tmp_path / "sweep"
    proc = run_train(*CHEAP, "optim.max_steps=2", "optim.lr=0.1,0.2", f"hydra.sweep.subdir={subdir}",
                     sweep_dir=sweep_dir, cache_dir=tmp_path / "cache", multirun=True, cwd=tmp_path,
                     env={"SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    shared = (r"error: sweep point #1 \([^)]*optim.lr=0.2[^)]*\): its run directory '[^']*' is sweep point "
              r"#0 \([^)]*optim.lr=0.1[^)]*\)'s too: [^;]*; nothing was submitted \(try hydra.sweep.subdir=")
    assert len(errors) == 1 and re.match(shared, errors[0]), proc.stderr[-3000:]
    assert not list(sweep_dir.glob("*/.switchyard/config.pkl")), "a point was written"
