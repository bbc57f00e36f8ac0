"""Shared fixtures. SLURM tests need the local cluster; under CI=true they fail instead of skipping,
so a CI run that silently executed no SLURM test cannot pass."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# One OpenMP thread per process the suite starts, as if each of the pytest-xdist workers had a
# core of its own (four share two). A lone rank's own budget (runtime.thread_budget, the cpuset's
# share) is two threads here, and GNU OpenMP's threads spin between torch's ops against the other
# workers' processes: the training test files took 14-17 % more CPU without this. Set before torch
# is imported anywhere; the workers' jobs, SLURM's included (sbatch exports it), inherit it, and a
# rank takes a user's OMP_NUM_THREADS as its own. A value set outside the suite wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cluster_problem() -> str | None:
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                              timeout=20, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"sinfo could not run: {e}"
    if proc.returncode != 0:
        return f"sinfo failed: {proc.stderr.strip()}"
    states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    usable = [n for n, s in states.items() if s.rstrip("*") in ("idle", "mix", "alloc")
              and not s.endswith("*")]
    if len(usable) < 2:
        return f"fewer than 2 usable nodes: {states}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = _cluster_problem()
    if problem is None:
        return
    message = f"local SLURM cluster not reachable ({problem}); run `switchyard cluster up` as root"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(autouse=True, scope="session")
def isolated_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every job, single ones included, enters the registry: tests that name none write to a
    session file, never to the user's ~/.local/share/switchyard/registry.db."""
    saved = os.environ.get("SWITCHYARD_REGISTRY")
    if saved is None:
        os.environ["SWITCHYARD_REGISTRY"] = str(tmp_path_factory.mktemp("registry") / "registry.db")
    yield
    if saved is None:
        os.environ.pop("SWITCHYARD_REGISTRY", None)


@pytest.fixture(autouse=True)
def isolated_environment() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it. Code a test runs in this process may set a
    variable a rank needs (``NCCL_DEBUG_FILE``, ``CUBLAS_WORKSPACE_CONFIG``, torch's inductor its
    own), and ``monkeypatch.delenv`` of an unset variable undoes nothing: left behind, it changed
    every later test on the worker, and sent their ``jobs.train`` runs to a new interpreter instead
    of the warm start (whose zygote takes this environment, as the first test found it)."""
    import warm_start

    saved = dict(os.environ)
    warm_start.Zygote.base_env()
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def isolated_hydra_version_base() -> Iterator[None]:
    """Hydra keeps ``version_base`` in a process-wide singleton: a test that composes with
    version_base="1.3" (no chdir) would otherwise change the defaults for every later test, e.g.
    Hydra's own launcher suites, which expect the unspecified default."""
    from hydra.version import VersionBase

    saved = VersionBase.instance()
    fresh = VersionBase.__new__(VersionBase)  # VersionBase() would return the singleton itself
    fresh.__init__()  # type: ignore[misc]
    VersionBase.set_instance(fresh)
    yield
    VersionBase.set_instance(saved)


# One lock for every pytest process on this machine (xdist workers, other checkouts' runs): the
# local cluster is one per machine.
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "switchyard-tests-cluster.lock"


@contextlib.contextmanager
def cluster_lock(exclusive: bool) -> Iterator[None]:
    """Held shared by every SLURM test while it runs, and exclusively by a test that stops the
    cluster (``cycles_cluster``). A gate taken before the main lock gives the exclusive holder
    precedence: once it waits, no new test starts beside it, so it waits only for those running."""
    CLUSTER_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{CLUSTER_LOCK}.gate", "a") as gate, open(CLUSTER_LOCK, "a") as main:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)


@pytest.fixture
def cluster_held(request: pytest.FixtureRequest) -> Iterator[None]:
    with cluster_lock(exclusive=cycles(request.node)):
        yield


def queues_jobs(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None and item.get_closest_marker("queues_nothing") is None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each module is a pytest-xdist group (``--dist loadgroup``), so its module-scoped fixtures
    run once, and the modules of SLURM tests that queue jobs come first: they are the longest, and
    most of their time is waiting for SLURM, so they run on every worker at once from the start.
    The partition oversubscribes (``OverSubscribe=FORCE:4``), so neighbours' jobs start beside
    each other; every SLURM test looks only at its own jobs. Each holds the cluster lock shared
    while it runs; the one test that stops and restarts the cluster holds it alone, so it comes
    last, in a group of its own: among the SLURM tests it waited (holding its worker) for every
    test running beside it, the longest of them minutes, while the workers that reached their next
    SLURM test waited for it."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.fixturenames[:0] = ["slurm_cluster", "cluster_held"]  # type: ignore[attr-defined]
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(f"{module}::cycles" if cycles(item) else module))
    items.sort(key=lambda item: (cycles(item), not queues_jobs(item)))  # stable: in order otherwise


def cycles(item: pytest.Item) -> bool:
    return item.get_closest_marker("cycles_cluster") is not None


# SWITCHYARD_TEST_CPU=FILE: one JSON line per test phase with the CPU seconds it cost, its own and
# its waited-for processes' (a jobs.train and the local ranks it waited for), beside its wall time,
# when it ended, on which worker (the timeline: which tests run alone at the end), and how many of
# its `jobs.train` runs started a new interpreter instead of the warm start (`cold_starts`).
# The suite is bound by CPU on two cores, so this, not --durations, says which tests to make
# cheaper (docs/development.md). SLURM jobs run under slurmd and are not in it.
_CPU_LEDGER = os.environ.get("SWITCHYARD_TEST_CPU")


def _cpu_s() -> float:
    """This worker's CPU seconds, with those of the processes it waited for and of those its warm
    start forked (``warm_start``: the zygote reaps those; they are not this process's children)."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("warm_start")
    forked = warm.unreaped_cpu_s() if warm is not None else 0.0
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + forked


def _cold_starts() -> int:
    warm = sys.modules.get("warm_start")
    return warm.COLD_STARTS if warm is not None else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not _CPU_LEDGER:
        yield
        return
    import json
    import time
    cpu, wall, cold = _cpu_s(), time.monotonic(), _cold_starts()
    yield
    with open(_CPU_LEDGER, "a") as ledger:
        ledger.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2),
                                 "wall_s": round(time.monotonic() - wall, 2), "ended": round(time.time(), 1),
                                 "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                                 "cold_starts": _cold_starts() - cold}) + "\n")
