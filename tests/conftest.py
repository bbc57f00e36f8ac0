"""Shared fixtures. SLURM tests need the local cluster; under CI=true they fail instead of skipping,
so a CI run that silently executed no SLURM test cannot pass."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest


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


def queues_jobs(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None and item.get_closest_marker("queues_nothing") is None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The SLURM tests that queue jobs first, all in one pytest-xdist group: under ``--dist
    loadgroup`` one worker runs them one after another (the two nodes hold one test's jobs at a
    time, as without xdist) from the start, while the other workers take the rest a module at a
    time, so a module-scoped fixture runs once. A SLURM test marked ``queues_nothing`` only asks the
    cluster (or is refused before sbatch): it goes with the rest, off the slurm group's worker."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.fixturenames.insert(0, "slurm_cluster")  # type: ignore[attr-defined]
        item.add_marker(pytest.mark.xdist_group("slurm" if queues_jobs(item) else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: not queues_jobs(item))  # stable: in order otherwise

