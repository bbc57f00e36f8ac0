"""The launcher end to end on this machine (hydra/launcher=switchyard_local), no SLURM needed:
a real Hydra app in a subprocess, the registry, and the `switchyard` commands."""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import sweep_probe
from train_helpers import run_train, train_command

from orchestrator.registry.db import Registry
from orchestrator.sweeps import status as sweep_status

SWITCHYARD = shutil.which("switchyard", path=str(Path(sys.executable).parent)) or "switchyard"


def write_app(tmp_path: Path, launcher: str = "switchyard_local") -> Path:
    return sweep_probe.write_app(tmp_path, launcher=launcher, label="${x}-from-yaml")


def env_for(tmp_path: Path) -> dict[str, str]:
    return sweep_probe.registry_env(tmp_path)


def run_app(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(tmp_path / "app.py"), "-m", *overrides], cwd=tmp_path,
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=300)


def switchyard(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SWITCHYARD, *args], env=env_for(tmp_path), capture_output=True, text=True,
                          timeout=120)


def status_json(tmp_path: Path, sweep: str) -> dict[str, Any]:
    proc = switchyard(tmp_path, "status", sweep, "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def status_here(tmp_path: Path, sweep: str) -> dict[str, Any]:
    """What ``status_json`` answers, from this process: a poll without a process start each time."""
    out = io.StringIO()
    with Registry(Path(env_for(tmp_path)["SWITCHYARD_REGISTRY"])) as reg:
        assert sweep_status.cmd_status(reg, sweep, True, out) == 0
    return dict(json.loads(out.getvalue()))


def wait_until_ended(tmp_path: Path, sweep: str, timeout_s: float = 120) -> dict[str, Any]:
    """Polls in this process; the answer is the ``switchyard status --json`` command's, once ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        polled = status_here(tmp_path, sweep)
        if all(j["state"] in ("COMPLETED", "FAILED", "CANCELLED") for j in polled["jobs"]):
            return status_json(tmp_path, sweep)
        assert time.monotonic() < deadline, polled
        time.sleep(0.2)


def runs(tmp_path: Path, x: int) -> int:
    return len(list((tmp_path / "out").glob(f"ran-{x}-*")))


def test_blocking_local_sweep_runs_every_point_and_records_it(tmp_path: Path) -> None:
    write_app(tmp_path)
    proc = run_app(tmp_path, "x=1,2,3", "hydra.launcher.array_parallelism=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Registry(Path(env_for(tmp_path)["SWITCHYARD_REGISTRY"])) as reg:  # kept as the sweep ended
        assert set(reg.results(1)) == {a.id for a in reg.latest_attempts(1).values()}
    assert [runs(tmp_path, x) for x in (1, 2, 3)] == [1, 1, 1]
    # the app imports no torch, and neither does Switchyard's side of its tasks (1 s of CPU each)
    assert {p.read_text() for p in (tmp_path / "out").glob("torch-*")} == {"False"}
    status = status_json(tmp_path, "1")
    assert [(j["job"], j["state"], j["exit_code"]) for j in status["jobs"]] == [
        ("1/0", "COMPLETED", 0), ("1/1", "COMPLETED", 0), ("1/2", "COMPLETED", 0)]
    run_dir = tmp_path / "multirun" / "1"
    assert (run_dir / ".switchyard" / "config.yaml").read_text().startswith("x: 2\n")
    assert (run_dir / ".hydra" / "overrides.yaml").exists()  # Hydra's own outputs, as usual


def test_each_jobs_provenance_is_kept_in_the_registry_and_shown_without_its_run_directory(
        tmp_path: Path) -> None:
    write_app(tmp_path)
    proc = run_app(tmp_path, "x=1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "multirun" / "1"
    written = json.loads((run_dir / "provenance.json").read_text())
    # the probe app's own imports (hydra, omegaconf), from its script: the task function's file
    assert written["packages"] == {"hydra-core": importlib.metadata.version("hydra-core"),
                                   "omegaconf": importlib.metadata.version("omegaconf")}
    (run_dir / "provenance.json").unlink()  # what show prints now comes from the registry alone
    shown = switchyard(tmp_path, "show", "1/1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["provenance"] == written
    text = switchyard(tmp_path, "show", "1/1").stdout
    assert f"config sha256: {written['config_sha256'][:16]}" in text and "versions: python " in text


def test_hydras_batches_of_one_sweep_are_recorded_as_one_sweep(tmp_path: Path) -> None:
    write_app(tmp_path)
    proc = run_app(tmp_path, "x=1,2,3", "hydra.sweeper.max_batch_size=2",
                   "hydra.launcher.array_parallelism=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = json.loads(switchyard(tmp_path, "status", "--json").stdout)["sweeps"]
    assert [(s["id"], s["jobs"], s["states"]) for s in sweeps] == [(1, 3, {"COMPLETED": 3})]


def test_a_failing_point_fails_the_blocking_sweep_with_its_own_error(tmp_path: Path) -> None:
    write_app(tmp_path)
    (tmp_path / "out" / "fail-2").touch()
    proc = run_app(tmp_path, "x=1,2")
    assert proc.returncode != 0
    assert "ValueError: x=2 was told to fail" in proc.stderr
    jobs = status_json(tmp_path, "1")["jobs"]
    assert [j["state"] for j in jobs] == ["COMPLETED", "FAILED"]
    assert jobs[1]["error"] == "ValueError: x=2 was told to fail"


def test_a_non_blocking_local_sweep_over_its_array_parallelism_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """Local jobs have no queue: with array_parallelism=1 a non-blocking sweep of 3 ran all 3 at
    once (issue 27). A blocking one keeps to it; one that does not wait is refused."""
    write_app(tmp_path)
    proc = run_app(tmp_path, "x=1,2,3", "hydra.launcher.wait=false", "hydra.launcher.array_parallelism=1")
    assert proc.returncode != 0, proc.stdout
    assert "3 local jobs with hydra.launcher.array_parallelism=1 and hydra.launcher.wait=false" in proc.stderr
    assert "nothing was started (try hydra.launcher.wait=true" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "registry.db").exists() and list((tmp_path / "out").glob("ran-*")) == []


def test_non_blocking_local_sweep_then_resubmit_only_the_failed_point(tmp_path: Path) -> None:
    write_app(tmp_path)
    (tmp_path / "out" / "fail-2").touch()
    proc = run_app(tmp_path, "x=1,2,3", "hydra.launcher.wait=false", "hydra.launcher.array_parallelism=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep_id: 1" in proc.stdout and "switchyard status 1" in proc.stdout
    status = wait_until_ended(tmp_path, "1")
    assert [j["state"] for j in status["jobs"]] == ["COMPLETED", "FAILED", "COMPLETED"]

    (tmp_path / "out" / "fail-2").unlink()
    resubmit = switchyard(tmp_path, "resubmit", "1", "--failed")
    assert resubmit.returncode == 0, resubmit.stderr
    assert "1/1" in resubmit.stdout and "1/0" not in resubmit.stdout
    status = wait_until_ended(tmp_path, "1")
    assert [(j["state"], j["attempt"]) for j in status["jobs"]] == [
        ("COMPLETED", 1), ("COMPLETED", 2), ("COMPLETED", 1)]
    assert [runs(tmp_path, x) for x in (1, 2, 3)] == [1, 2, 1]


def test_commands_explain_a_name_that_matches_nothing(tmp_path: Path) -> None:
    proc = switchyard(tmp_path, "logs", "7/0")
    assert proc.returncode == 2
    assert "no job 0" in proc.stderr or "no sweep 7" in proc.stderr
    proc = switchyard(tmp_path, "resubmit", "7")
    assert proc.returncode == 2 and "--failed" in proc.stderr


def rank_pid(tmp_path: Path, x: int) -> int:
    """The pid of the process running point ``x`` (the probe names its marker after it)."""
    (marker,) = (tmp_path / "out").glob(f"ran-{x}-*")
    return int(marker.name.rsplit("-", 1)[1])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_cancel_stops_local_jobs_even_when_they_ignore_sigterm(tmp_path: Path) -> None:
    """The probe is a plain function, so submitit's rank entry point bypasses SIGTERM: after
    the grace period its processes are killed, as slurmd kills after KillWait."""
    write_app(tmp_path)
    # run_app captures the output through pipes: it returns only because the controllers
    # write to their own log, not to the pipes (they used to hold them open until the jobs ended).
    proc = run_app(tmp_path, "x=1,2", "sleep_s=600", "hydra.launcher.wait=false",
                   "hydra.launcher.array_parallelism=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "multirun" / ".submitit" / "local-controllers.log").exists()
    deadline = time.monotonic() + 120
    while runs(tmp_path, 1) + runs(tmp_path, 2) < 2:
        assert time.monotonic() < deadline, status_json(tmp_path, "1")
        time.sleep(0.2)
    jobs = {j["job"]: j for j in status_json(tmp_path, "1")["jobs"]}
    controllers = {x: int(jobs[f"1/{x - 1}"]["slurm_id"]) for x in (1, 2)}
    ranks = {x: rank_pid(tmp_path, x) for x in (1, 2)}

    one = switchyard(tmp_path, "cancel", "1/0", "--grace", "1")
    assert one.returncode == 0, one.stderr
    assert "cancelled 1 job(s)" in one.stdout
    assert gone(ranks[1]) and gone(controllers[1])  # cancel returns once they are gone
    assert not gone(ranks[2]) and not gone(controllers[2])  # the other job runs on

    rest = switchyard(tmp_path, "cancel", "1", "--grace", "1")
    assert "cancelled 1 job(s)" in rest.stdout, rest.stderr
    assert gone(ranks[2]) and gone(controllers[2])
    assert [j["state"] for j in status_json(tmp_path, "1")["jobs"]] == ["CANCELLED", "CANCELLED"]
    assert "nothing to cancel" in switchyard(tmp_path, "cancel", "1").stdout
    bad = switchyard(tmp_path, "cancel", "1", "--grace", "-1")
    assert bad.returncode == 2 and "--grace -1.0 is invalid" in bad.stderr


def test_cancel_stops_a_local_training_job_at_a_step_boundary_with_a_checkpoint(tmp_path: Path) -> None:
    """The trainer acts on cancel's SIGTERM as on SLURM preemption: all ranks stop at the same
    step and rank 0 checkpoints, well before the grace period would have SIGKILLed them."""
    proc = run_train("cluster=local", "cluster.wait=false", "optim.max_steps=1000000", "log_every_steps=1",
                     cache_dir=tmp_path / "cache", sweep_dir=tmp_path / "multirun", multirun=True,
                     env=env_for(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = tmp_path / "multirun" / "0" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() < deadline, status_json(tmp_path, "1")
        time.sleep(0.2)

    started = time.monotonic()
    cancel = switchyard(tmp_path, "cancel", "1", "--grace", "100")
    assert "cancelled 1 job(s)" in cancel.stdout, cancel.stderr
    assert time.monotonic() - started < 60  # stopped on SIGTERM, not killed after the grace
    assert list((tmp_path / "multirun" / "0" / "checkpoints").glob("step-*.pt"))
    logs = "".join(p.read_text() for p in (tmp_path / "multirun").rglob("*_0_log.out"))
    assert "stopped by PREEMPTED at step" in logs
    assert [j["state"] for j in status_json(tmp_path, "1")["jobs"]] == ["CANCELLED"]


def test_a_cancelled_blocking_local_run_reports_a_cancellation_with_where_it_stopped(tmp_path: Path) -> None:
    """The ranks stop cleanly on cancel's SIGTERM and leave no result: the blocking submitter read
    that as a death (`error: ... rank 0 ... no result`, exit 2, the job FAILED). Now: `stopped:`,
    the step and the checkpoint, exit 143, and CANCELLED with the same words in status."""
    run_dir = tmp_path / "run"
    submitter = subprocess.Popen(
        train_command("cluster=local", "optim.max_steps=1000000", "log_every_steps=1",
                      cache_dir=tmp_path / "cache", run_dir=run_dir),
        env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists()
                   and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and submitter.poll() is None, submitter.communicate()
            time.sleep(0.2)
        cancel = switchyard(tmp_path, "cancel", "1", "--grace", "5")
        assert "cancelled 1 job(s)" in cancel.stdout, cancel.stderr
        _, stderr = submitter.communicate(timeout=120)
    finally:
        if submitter.poll() is None:
            submitter.kill()
            switchyard(tmp_path, "cancel", "1", "--grace", "0")
    assert submitter.returncode == 143, stderr[-3000:]
    assert re.search(r"stopped: job \d+ was stopped \(CANCELLED\): stopped by PREEMPTED at step \d+; "
                     rf"checkpoint in {re.escape(str(run_dir / 'checkpoints'))}", stderr), stderr[-3000:]
    assert "error:" not in stderr
    (job,) = status_json(tmp_path, "1")["jobs"]
    assert job["state"] == "CANCELLED" and "stopped by PREEMPTED at step" in job["error"], job


def damage(path: Path) -> None:
    """Overwrite every page but the first (the header and the schema), as a bad disk region or a
    stray write would: the file still opens, and the first query on a table meets the damage."""
    page = int.from_bytes(path.read_bytes()[16:18], "big")  # SQLite's page size, from its header
    with open(path, "r+b") as f:
        f.seek(page)
        f.write(b"\xff" * (path.stat().st_size - page))


def test_a_damaged_registry_is_one_line_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    """Before: sqlite3.DatabaseError 'database disk image is malformed' as a raw traceback, from the
    CLI and from the launcher."""
    write_app(tmp_path)
    assert run_app(tmp_path, "x=1,2,3").returncode == 0
    registry = Path(env_for(tmp_path)["SWITCHYARD_REGISTRY"])
    damage(registry)
    for proc in (switchyard(tmp_path, "status"), run_app(tmp_path, "x=4,5")):
        assert proc.returncode != 0
        assert f"the sweep registry {registry} cannot be read (" in proc.stderr, proc.stderr[-2000:]
        assert f"mv {registry} {registry}.damaged" in proc.stderr
        assert "Traceback" not in proc.stderr
    registry.write_text("not a database " * 100)
    proc = switchyard(tmp_path, "status")
    assert proc.returncode == 2 and "cannot be read (file is not a database)" in proc.stderr
