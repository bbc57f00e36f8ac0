"""Forked ranks (``cluster.rank_start``): a local job's controller imports once and forks its ranks.

What the forked ranks must keep from started ones is tested where it is tested for both starts:
failure naming in ``test_local_ddp.py`` (both starts), the frozen rank in ``test_heartbeat.py``,
SIGTERM's checkpoint in ``tests/jobs/test_fsdp.py`` (forked, the default for ``cluster=local``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
from train_helpers import CHEAP, run_train

from jobs import smoke
from orchestrator.config import ClusterConfig, ConfigError, ParallelismConfig
from orchestrator.launch import fork_start, local_jobs, submit
from orchestrator.launch.fork_start import ForkingLocalExecutor

FORKED_LINE = "switchyard: rank process forked from the job's controller"


def logs(run_dir: Path, suffix: str = "out") -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "submitit").glob(f"*_log.{suffix}")))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_forked_ranks_train_exactly_as_started_ranks(tmp_path: Path, strategy: str) -> None:
    """Same losses to the last bit, eval included: the ranks seed after the fork, as before."""
    summaries = {}
    for start in ("fork", "spawn"):
        run_dir = tmp_path / start
        done = run_train("optim.max_steps=6", "data.demo_num_samples=512", "data.batch_size=16",
                         "eval_every_steps=3", *CHEAP, f"cluster.rank_start={start}",
                         f"parallelism.strategy={strategy}",
                         run_dir=run_dir, cache_dir=tmp_path / "cache")
        assert done.returncode == 0, done.stderr[-3000:]
        summaries[start] = json.loads((run_dir / "summary.json").read_text())
        assert (FORKED_LINE in logs(run_dir)) == (start == "fork")
        assert (any(run_dir.glob("submitit/*_forked_ranks.json"))) == (start == "fork")
    for key in ("final_train_loss", "final_eval_loss", "samples_per_rank", "eval_samples_counted"):
        assert summaries["fork"][key] == summaries["spawn"][key], key


def test_an_import_that_starts_a_thread_starts_the_ranks_as_new_processes(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread at the fork would be missing in every child, with whatever lock it held: no fork,
    the controller says why and starts the ranks as submitit does."""
    (tmp_path / "threads_at_import.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))  # for the controller
    executor = submit.make_executor(ClusterConfig(mode="local"), ParallelismConfig(procs_per_node=2),
                                    tmp_path / "jobs", rank_modules=("threads_at_import",))
    results = submit.results(submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv")))
    assert sorted(r["reduced"] for r in results) == [3.0, 3.0]
    assert "ranks start as new processes, not forked: an import started 1 thread(s)" in capfd.readouterr().err
    assert FORKED_LINE not in "".join(p.read_text() for p in (tmp_path / "jobs").glob("*_log.out"))


# A rank that says who it is, then waits to be looked at: exec is a builtin, so it pickles by name.
WAIT_TO_BE_SEEN = """
import os, time, pathlib
folder = pathlib.Path(os.environ["SUBMITIT_FOLDER"])
(folder / f"pid-{os.environ['SUBMITIT_LOCAL_LOCALID']}").write_text(str(os.getpid()))
while not (folder / "seen").exists():
    time.sleep(0.05)
"""


# Preloaded by the controller: its list of ranks is written a second late, as on a loaded machine.
LIST_LATE = """
import time
from durable import atomic
write_json = atomic.write_json
def late(path, *args, **kwargs):
    if str(path).endswith("_forked_ranks.json"):
        time.sleep(1.0)
    return write_json(path, *args, **kwargs)
atomic.write_json = late
"""


@pytest.mark.parametrize("setup", [[], ["export SWITCHYARD_TEST_SETUP=1"]])
def test_forked_ranks_are_found_by_their_local_id(tmp_path: Path, setup: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked rank's command line and environment are its controller's: the controller's list
    is what tells the fail-fast wait and ``switchyard run``'s rank ends which rank is which. With
    setup lines (CUDA_VISIBLE_DEVICES by UUID) the job's id is a shell's, the controller its child.
    A rank runs only once it is on the list: here the list is written a second late, and ranks
    that ran before it (the old order, which failed in CI) would be found as nothing."""
    (tmp_path / "list_late.py").write_text(LIST_LATE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))  # for the controller
    folder = tmp_path / "jobs"
    executor = ForkingLocalExecutor(folder, ["jobs.smoke", "list_late"])
    executor.update_parameters(tasks_per_node=2, nodes=1, timeout_min=5, setup=setup)
    job = executor.submit(exec, WAIT_TO_BE_SEEN)
    try:
        deadline = time.monotonic() + 120
        while not all((folder / f"pid-{k}").exists() for k in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        found = local_jobs.ranks(int(job.job_id))
        assert {k: p.pid for k, p in found.items()} == {
            k: int((folder / f"pid-{k}").read_text()) for k in (0, 1)}
        [parent] = {p.parent().pid for p in found.values()}  # forked by one controller
        assert local_jobs.controller(parent) is not None
    finally:
        (folder / "seen").touch()
    job.wait()
    assert job.done() and not any(t.exception() for t in job._sub_jobs)


def test_fork_is_refused_where_the_ranks_must_be_their_own_processes() -> None:
    from orchestrator.config import ContainerConfig

    with pytest.raises(ConfigError, match=r"cluster.rank_start='fork' is invalid: ranks cannot be forked "
                                          r"with cluster=debug: the job runs in this process "
                                          r"\(try cluster.rank_start=auto\)"):
        ClusterConfig(mode="debug", rank_start="fork")
    with pytest.raises(ConfigError, match=r"with cluster.container.runtime=apptainer: the node launcher"):
        ClusterConfig(mode="slurm", rank_start="fork",
                      container=ContainerConfig(runtime="apptainer", image="/images/a.sif"))
    with pytest.raises(ConfigError, match=r"with --gpus-per-task=1 in cluster.srun_args: SLURM binds"):
        ClusterConfig(mode="slurm", rank_start="fork", srun_args=["--gpus-per-task=1"])


def test_auto_forks_on_local_and_slurm_and_leaves_the_rest_to_srun() -> None:
    from orchestrator.config import ContainerConfig

    assert ClusterConfig(mode="local").forks_ranks and ClusterConfig(mode="slurm").forks_ranks
    assert ClusterConfig(mode="slurm", rank_start="fork").forks_ranks
    assert not ClusterConfig(mode="slurm", rank_start="spawn").forks_ranks
    assert not ClusterConfig(mode="debug").forks_ranks
    assert not ClusterConfig(mode="slurm", srun_args=["--gpus-per-task=1"]).forks_ranks
    assert not ClusterConfig(mode="slurm", container=ContainerConfig(runtime="apptainer",
                                                                     image="/images/a.sif")).forks_ranks


@pytest.mark.parametrize(("strategy", "fsdp_preloaded"), [("ddp", False), ("fsdp", True)])
def test_the_controller_imports_what_the_strategy_needs(strategy: str, fsdp_preloaded: bool) -> None:
    """DDP's constructor imports ``torch._dynamo``; fsdp's stack only where the run shards."""
    from hydra import compose, initialize_config_module

    from jobs.train import load_config
    from orchestrator.training.rank_process import rank_modules

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = load_config(compose(config_name="train", overrides=[f"parallelism.strategy={strategy}"]))
    modules = rank_modules(cfg)
    assert "orchestrator.training.rank_process" in modules and "torch._dynamo" in modules
    assert ("torch.distributed.fsdp" in modules) == fsdp_preloaded


# What a rank reports of the process that forked it: the job's controller.
CONTROLLER_PROBE = """
import os, psutil
def controller_of_me():
    controller = psutil.Process(os.getppid())
    return {"pid": controller.pid, "name": controller.name(), "parent": controller.ppid(),
            "command": " ".join(controller.cmdline()), "rank_name": psutil.Process().name()}
"""
# A submitting process as ``python -m jobs.train`` is one: imports with one BLAS/OpenMP thread, a
# template forked, then two local jobs (the template serves the first).
SUBMITTER = """
import json, os, sys
from orchestrator.launch import fork_safety
fork_safety.hold_thread_pools()
import torch
from orchestrator.config import ClusterConfig, ParallelismConfig
from orchestrator.launch import fork_start, submit
import controller_probe
fork_safety.restore_thread_vars()
if sys.argv[2] == "thread":  # a thread at the fork would be missing in the template
    import threading
    threading.Thread(target=__import__("time").sleep, args=(60,), daemon=True).start()
fork_start.fork_template()
made = fork_start._TEMPLATE is not None
seen = []
for k in range(int(sys.argv[3])):
    executor = submit.make_executor(ClusterConfig(mode="local"), ParallelismConfig(procs_per_node=2),
                                    __import__("pathlib").Path(sys.argv[1]) / str(k),
                                    rank_modules=("controller_probe",))
    job = submit.submit(executor, controller_probe.controller_of_me)
    seen.append({"job_id": job.job_id, "ranks": submit.results(job)})
print(json.dumps({"submitter": os.getpid(), "template": made, "jobs": seen}))
"""


def run_submitter(tmp_path: Path, thread: bool, jobs: int) -> dict[str, Any]:
    """``SUBMITTER`` in a new interpreter, a thread started before its fork or not; what it saw."""
    (tmp_path / "controller_probe.py").write_text(CONTROLLER_PROBE)
    done = subprocess.run([sys.executable, "-c", SUBMITTER, str(tmp_path / "jobs"),
                           "thread" if thread else "none", str(jobs)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return cast(dict[str, Any], json.loads(done.stdout.splitlines()[-1]))


def test_a_local_jobs_controller_is_forked_from_its_submitter(tmp_path: Path) -> None:
    """The first local job's controller is the template the submitter forked after its imports:
    the submitter's child, named so that ``switchyard cancel`` and the fail-fast wait know it, its
    ranks forked from it. The second job's controller is started, as every one was before."""
    seen = run_submitter(tmp_path, thread=False, jobs=2)
    assert seen["template"]
    forked, started = seen["jobs"]
    for job in (forked, started):
        [controller] = {json.dumps(r, sort_keys=True) for r in job["ranks"]}  # both ranks: one parent
        job["controller"] = json.loads(controller)
        assert job["controller"]["pid"] == int(job["job_id"])
        assert job["controller"]["parent"] == seen["submitter"]
    assert forked["controller"]["name"] == local_jobs.FORKED_CONTROLLER
    assert forked["controller"]["rank_name"] != local_jobs.FORKED_CONTROLLER  # a rank is no controller
    assert "orchestrator.launch.fork_start" not in forked["controller"]["command"]  # the submitter's
    assert "orchestrator.launch.fork_start" in started["controller"]["command"]
    assert FORKED_LINE in "".join(p.read_text() for p in (tmp_path / "jobs" / "0").glob("*_log.out"))


def test_no_template_is_forked_from_a_process_with_a_thread(tmp_path: Path) -> None:
    """A thread would be missing in the template, with whatever lock it held: the same submitter
    as above forks none with one thread more, and its job's controller is started."""
    seen = run_submitter(tmp_path, thread=True, jobs=1)
    assert not seen["template"]
    [job] = seen["jobs"]
    assert all("orchestrator.launch.fork_start" in rank["command"] for rank in job["ranks"])


def test_a_template_no_job_takes_exits_when_released() -> None:
    """A SLURM or debug run releases it at once; a run that ends before submitting closes its end."""
    ours, its = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the template's side, as ControllerTemplate.fork runs it
        ours.close()
        fork_start.serve_once(its)
    its.close()
    fork_start.ControllerTemplate(pid, ours).release()  # reaps it: it has exited
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_dead_template_leaves_the_controller_to_be_started(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A template killed before the job (the OOM killer, a stray signal) costs a started controller,
    not the submission."""
    ours, its = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # a template that died at once
    its.close()
    os.waitpid(pid, 0)  # gone, and its end of the socket with it
    monkeypatch.setattr(fork_start, "_TEMPLATE", fork_start.ControllerTemplate(pid, ours))
    executor = submit.make_executor(ClusterConfig(mode="local"), ParallelismConfig(procs_per_node=2),
                                    tmp_path / "jobs", rank_modules=("jobs.smoke",))
    results = submit.results(submit.submit(executor, smoke.allreduce, str(tmp_path / "rdzv")))
    assert sorted(r["reduced"] for r in results) == [3.0, 3.0]
    assert fork_start._TEMPLATE is None
