"""switchyard.submit in local and debug mode: every rank runs the function with the process group's
variables set, and the job returns each rank's result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_helpers import FUNCTION_PROGRAM


def run_program(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "program.py").write_text(FUNCTION_PROGRAM)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "program.py", str(run_dir), *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")})
    return proc, run_dir


def results_of(proc: subprocess.CompletedProcess[str]) -> list[dict]:  # type: ignore[type-arg]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("results "))
    return json.loads(line.removeprefix("results "))  # type: ignore[no-any-return]


def test_a_function_runs_on_every_local_rank_and_returns_each_ranks_result(tmp_path: Path) -> None:
    proc, run_dir = run_program(tmp_path, "parallelism.procs_per_node=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = results_of(proc)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 12.0 and r["run_dir"] == str(run_dir) for r in results)
    assert "ref 1/0" in proc.stdout and "status COMPLETED" in proc.stdout
    assert (run_dir / "telemetry" / "ranks" / "rank-2.json").exists()
    assert "procs_per_node: 3" in (run_dir / "config.yaml").read_text()


def test_debug_mode_runs_the_function_in_this_process(tmp_path: Path) -> None:
    proc, _ = run_program(tmp_path, "cluster=debug")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["rank"], r["world"], r["sum"]) for r in results_of(proc)] == [(0, 1, 2.0)]


def test_a_bad_override_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc, run_dir = run_program(tmp_path, "parallelism.nodes=0")
    assert proc.returncode != 0 and "parallelism.nodes=0 is invalid" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("name", ["Job", "submit"])
def test_the_package_exports_the_api_lazily(name: str) -> None:
    import switchyard

    assert getattr(switchyard, name) is not None


def test_a_dry_run_is_refused_instead_of_queued(tmp_path: Path) -> None:
    """``cluster.dry_run=true`` queued the function anyway: the function API returns a job, and a
    dry run has none."""
    from orchestrator.config import ConfigError
    from switchyard import submit

    with pytest.raises(ConfigError, match=r"cluster.dry_run=true is not for switchyard.submit"):
        submit(sorted, [2, 1], overrides=["cluster=slurm", "cluster.dry_run=true"], run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "submitit").exists()
