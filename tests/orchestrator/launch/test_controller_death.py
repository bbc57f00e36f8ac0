"""A local job whose controller is killed outright (``kill -9``, the OOM killer): its ranks die with
it, as SLURM's die with their launcher, and ``switchyard cancel`` stops any process of it still
running (issue 53, item 5)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_helpers import CHEAP, train_command

from orchestrator.launch import local_jobs, single
from orchestrator.registry.db import Registry
from orchestrator.sweeps.status import cmd_cancel


def wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.1)


def training_ranks(run_dir: Path) -> tuple[int, list[psutil.Process]]:
    """The controller's pid (the local job's id) and its two ranks, once both have trained a step."""
    logs = run_dir / "submitit"
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and list(logs.glob("*_1_log.out")), 180,
             "the ranks' first steps")
    controller = int(next(logs.glob("*_0_log.out")).name.split("_")[0])
    ranks = local_jobs.ranks(controller, logs)
    assert sorted(ranks) == [0, 1]
    return controller, list(ranks.values())


@pytest.mark.parametrize("rank_start", ["fork", "spawn"])
def test_the_ranks_die_with_their_killed_controller(tmp_path: Path, rank_start: str) -> None:
    run_dir = tmp_path / "run"
    command = train_command(*CHEAP, "optim.max_steps=1000000", "log_every_steps=1",
                            "data.demo_num_samples=256", "data.batch_size=16",
                            f"cluster.rank_start={rank_start}", run_dir=run_dir,
                            cache_dir=tmp_path.parent / "demo-cache")
    with open(tmp_path / "submitter.log", "w") as log:
        submitter = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    ranks: list[psutil.Process] = []
    try:
        controller, ranks = training_ranks(run_dir)
        os.kill(controller, signal.SIGKILL)
        wait_for(lambda: not any(local_jobs.alive(r) for r in ranks), 30, "the ranks to die with it")
        assert submitter.wait(timeout=60) != 0
    finally:
        for process in ranks:
            if local_jobs.alive(process):
                process.kill()
        if submitter.poll() is None:
            submitter.kill()
        submitter.wait(timeout=30)


# A controller as `switchyard cancel` knows one (its process name), whose rank asked for no
# parent-death signal: a rank forked before this fix, or one whose request came too late.
OLD_CONTROLLER = """
import json, os, sys, time
from pathlib import Path
from orchestrator.launch import fork_start, local_jobs
fork_start.name_process(local_jobs.FORKED_CONTROLLER)
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the test reads the controller's pipe to its end
    time.sleep(600)
    os._exit(0)
json.dump({str(pid): 0}, open(local_jobs.forked_ranks_file(Path(sys.argv[1]), os.getpid()), "w"))
print(pid, flush=True)
time.sleep(600)
"""


def test_cancel_stops_the_ranks_a_dead_controller_left_running(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "submitit"
    folder.mkdir(parents=True)
    controller = subprocess.Popen([sys.executable, "-c", OLD_CONTROLLER, str(folder)], stdout=subprocess.PIPE,
                                  text=True)
    assert controller.stdout is not None
    rank = psutil.Process(int(controller.stdout.readline()))
    try:
        recorded = single.record("jobs.train", "python -m jobs.train", tmp_path / "run", "local",
                                 str(controller.pid), folder, [], "{}\n")
        controller.kill()
        controller.wait()
        single.finish(recorded, "FAILED", 1, "the controller was killed")  # as the submitter saw it
        assert local_jobs.alive(rank)
        out = io.StringIO()
        with Registry(recorded.registry) as registry:
            assert cmd_cancel(registry, recorded.ref, as_json=False, out=out, grace_s=2) == 0
        assert out.getvalue() == (f"stopped 1 process(es) of local job {controller.pid} still running "
                                  f"after its controller had died\n")
        wait_for(lambda: not local_jobs.alive(rank), 15, "the leftover rank to stop")
        with Registry(recorded.registry) as registry:
            assert registry.latest_attempts(recorded.sweep_id)[0].state == "FAILED"  # as it ended
    finally:
        if local_jobs.alive(rank):
            rank.kill()
