"""`switchyard run -- COMMAND` in local and debug mode: an unmodified torchrun-style script as
every rank, the run directory, the registry entry, and a failing rank named with its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_helpers import DDP_SCRIPT, LATE_FAILURE_SCRIPT

from orchestrator.launch import rank_env, rendezvous
from orchestrator.launch.dist_env import DistEnv


def switchyard_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                   timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db"),
                               **(env or {})})


def rank_lines(run_dir: Path) -> list[str]:
    logs = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob("*_log.out")))
    return [line for line in logs.splitlines() if line.startswith("rank ") and "sum=" in line]


def test_an_unmodified_ddp_script_runs_as_every_local_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = switchyard_run(tmp_path, f"hydra.run.dir={run_dir}", "parallelism.procs_per_node=3",
                          "--", sys.executable, "ddp.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = rank_lines(run_dir)
    assert sorted(line.split()[1] for line in lines) == ["0/3", "1/3", "2/3"]
    assert all("sum=6" in line and f"run {run_dir}" in line for line in lines), lines
    assert (run_dir / "command.sh").read_text().endswith(f"{sys.executable} ddp.py\n")
    assert "procs_per_node: 3" in (run_dir / "config.yaml").read_text()
    variables = json.loads((run_dir / "env" / "rank-2.json").read_text())["set"]
    assert variables["RANK"] == "2" and variables["WORLD_SIZE"] == "3" and variables["MASTER_PORT"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["memory"]["mode"] == "cpu"
    assert {r["rank"] for r in summary["memory"]["ranks"]} == {0, 1, 2}  # the scripts' own memory
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1/0", "--json"],
                            capture_output=True, text=True, env={**os.environ,
                            "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}, check=True)
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["state"] == "COMPLETED" and job["run_dir"] == str(run_dir)
    # a rank the job does not have was "(empty: not written yet)", exit 0: the job records its ranks
    logs = subprocess.run([sys.executable, "-m", "orchestrator.cli", "logs", "1/0", "--rank", "3"],
                          capture_output=True, text=True, env={**os.environ,
                          "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    assert (logs.returncode, logs.stdout) == (2, "")
    assert logs.stderr == ("switchyard logs: error: --rank 3 is invalid: job 1/0 has 3 ranks (0..2) "
                           "(try --rank 0)\n")


def test_a_rank_exiting_3_fails_the_job_fast_naming_it_and_its_last_lines(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = switchyard_run(tmp_path, f"hydra.run.dir={run_dir}", "parallelism.procs_per_node=3",
                          "--", sys.executable, "ddp.py", env={"FAIL_RANK": "1"})
    assert proc.returncode == 2
    assert time.monotonic() - started < 120
    error = proc.stderr
    assert "rank 1 on node" in error and "exited with status 3" in error, error
    assert "rank 1 gives up here" in error and "the last words of the failing rank" in error
    assert "were stopped after rank 1 failed" in error
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"],
                            capture_output=True, text=True, env={**os.environ,
                            "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}, check=True)
    assert json.loads(status.stdout)["jobs"][0]["state"] == "FAILED"


def test_a_rank_failing_after_rank_0_finished_leaves_its_exit_status_in_the_summary(tmp_path: Path) -> None:
    (tmp_path / "late.py").write_text(LATE_FAILURE_SCRIPT)
    run_dir = tmp_path / "run"
    proc = switchyard_run(tmp_path, f"hydra.run.dir={run_dir}", "--", sys.executable, "late.py")
    assert proc.returncode == 2 and "rank 1 on node" in proc.stderr, proc.stderr
    assert "exited with status 3" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 3, summary  # was 0: rank 0's own end
    assert "after rank 1 had failed" in summary["error"]


def test_debug_mode_runs_the_command_as_one_rank_in_this_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = switchyard_run(tmp_path, f"hydra.run.dir={run_dir}", "cluster=debug",
                          "--", sys.executable, "ddp.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0/1 local 0/1" in proc.stdout and "sum=1" in proc.stdout


@pytest.mark.parametrize(("command", "expected"), [
    ([], "nothing to run"),
    (["no-such-program-here"], "'no-such-program-here' is not found on PATH"),
    ([sys.executable, "missing.py"], "the script 'missing.py' does not exist"),
])
def test_a_command_that_cannot_run_is_refused_before_anything_starts(
        tmp_path: Path, command: list[str], expected: str) -> None:
    proc = switchyard_run(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "--", *command)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "submitit").exists()


def test_without_the_separator_the_usage_is_named(tmp_path: Path) -> None:
    proc = switchyard_run(tmp_path, "cluster=local", "python", "ddp.py")
    assert proc.returncode == 2 and "put it after `--`" in proc.stderr


def test_each_rank_gets_torchruns_variables_and_the_run_directory(tmp_path: Path) -> None:
    env = DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
                  master_addr="n1", hostname="n2", job_id="77", restart_count=1, source="slurm")
    variables = rank_env.rank_variables(env, rendezvous.Endpoint("n1", 40123), tmp_path, max_requeues=3)
    assert {k: variables[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                      "MASTER_ADDR", "MASTER_PORT")} == \
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
         "MASTER_ADDR": "n1", "MASTER_PORT": "40123"}
    assert variables["SWITCHYARD_RUN_DIR"] == str(tmp_path) and variables["SWITCHYARD_RESTART_COUNT"] == "1"
    assert variables["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the ranks join the store served for them


def test_asking_for_a_requeue_outside_slurm_says_how_to_continue(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = switchyard_run(tmp_path, f"hydra.run.dir={run_dir}", "parallelism.procs_per_node=1",
                          "--", sys.executable, "-c", "raise SystemExit(75)")
    assert proc.returncode == 2
    assert "asked to be requeued (exit 75), but only SLURM requeues" in proc.stderr, proc.stderr
    assert f"hydra.run.dir={run_dir}" in proc.stderr


def test_a_rank_killed_outright_is_named_with_its_signal(tmp_path: Path) -> None:
    script = ("import os, signal, time\n"
              "if os.environ['RANK'] == '1':\n"
              "    print('rank 1 is about to be killed', flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(120)\n")
    (tmp_path / "killed.py").write_text(script)
    started = time.monotonic()
    proc = switchyard_run(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "--", sys.executable, "killed.py")
    assert proc.returncode == 2 and time.monotonic() - started < 90
    assert "rank 1 on node" in proc.stderr
    assert "was killed by SIGKILL (" in proc.stderr
    # The OOM killer is named only as the kernel says: here its memory cgroup counted no OOM kill.
    assert "(the OOM killer" not in proc.stderr
    assert "rank 1 is about to be killed" in proc.stderr
    assert "ranks [0] were stopped after rank 1 failed" in proc.stderr, proc.stderr


def test_help_names_what_each_rank_receives(tmp_path: Path) -> None:
    proc = switchyard_run(tmp_path, "--help")
    assert proc.returncode == 0 and "MASTER_PORT" in proc.stdout and "SWITCHYARD_RUN_DIR" in proc.stdout


def test_cancel_stops_every_ranks_command_in_local_mode(tmp_path: Path) -> None:
    import psutil

    (tmp_path / "wait.py").write_text("import os, signal, sys, time\n"
                                      "def stop(*_):\n"
                                      "    open(f\"term-{os.environ['RANK']}\", 'w').close()\n"
                                      "    sys.exit(0)\n"
                                      "signal.signal(signal.SIGTERM, stop)\n"
                                      "time.sleep(600)\n")
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    out, err = tmp_path / "submitter.out", tmp_path / "submitter.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        submitter = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run",
                                      f"hydra.run.dir={tmp_path / 'run'}", "--", sys.executable, "wait.py"],
                                     cwd=tmp_path, env=env, stdout=stdout, stderr=stderr)

    def commands() -> list[psutil.Process]:  # the ranks' `python wait.py`, not the submitter
        return [p for p in psutil.process_iter(["cmdline", "cwd"])
                if (p.info["cmdline"] or [])[1:] == ["wait.py"] and p.info["cwd"] == str(tmp_path)]

    try:
        deadline = time.monotonic() + 120
        while len(commands()) < 2:
            assert time.monotonic() < deadline, "the ranks' commands never started"
            time.sleep(0.2)
        cancel = subprocess.run([sys.executable, "-m", "orchestrator.cli", "cancel", "1", "--grace", "10",
                                 "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert json.loads(cancel.stdout)["cancelled"] == ["1/0"], cancel.stderr
        assert commands() == []
        # SIGTERM reached each rank's command through its Switchyard process, not SIGKILL at the end
        assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists()
        status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "1", "--json"], env=env,
                                capture_output=True, text=True, check=True)
        assert json.loads(status.stdout)["jobs"][0]["state"] == "CANCELLED"
        # The commands exited 0 on SIGTERM, but stopped is not done: the waiting submitter says what
        # the registry says (it printed "done: 2 rank(s) ... exited 0" and exited 0 before)
        assert submitter.wait(timeout=60) == 143, out.read_text() + err.read_text()
        assert "done:" not in out.read_text()
        assert re.search(r"^stopped: job \S+ was stopped \(CANCELLED\): switchyard: rank \d stopped by "
                         r"SIGTERM \(preemption or cancel\) \(its command exited 0 after it\)$",
                         err.read_text(), re.MULTILINE), err.read_text()
    finally:
        submitter.kill()
        submitter.wait()
