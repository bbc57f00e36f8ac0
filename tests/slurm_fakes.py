"""SLURM commands as small scripts first on PATH, for tests that need SLURM to answer in a way the
real commands cannot be made to on demand: fail, or report a small limit.

Shared by the sweep and slurm_query tests (pytest puts tests/ on sys.path; not collected).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **bodies: str) -> Path:
    """Each keyword a SLURM command as a bash snippet (``$ids``: its last argument, the ``-j`` list
    of sacct and squeue); every call's name and last argument are appended to the returned log.
    submitit's executor looks for ``srun`` before it submits, so a faked sbatch comes with an
    ``srun`` that does nothing: the test runs on a machine without SLURM installed."""
    if "sbatch" in bodies:
        bodies.setdefault("srun", "true")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for name, body in bodies.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/bash\nids="${{@: -1}}"\necho "{name} $ids" >> {log}\n{body}\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def calls(log: Path, name: str) -> list[str]:
    """The last argument of each call of ``name``, in order."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split(" ", 1)[1] for line in lines if line.startswith(f"{name} ")]


def scontrol_config(max_array_size: int, max_job_count: int) -> str:
    """A fake scontrol's body: ``show config`` lines with these limits."""
    return (f'printf "MaxArraySize            = {max_array_size}\\nMaxJobCount             = '
            f'{max_job_count}\\nMinJobAge               = 300 sec\\n"')


def limiting_scontrol(bin_dir: Path, **limits: int) -> Path:
    """The real scontrol, except that ``show config`` reports these limits (``MaxArraySize=3``):
    everything else, sbatch and the jobs included, runs on the real cluster. Returns bin_dir."""
    real = shutil.which("scontrol")
    assert real is not None, "scontrol is not on PATH"
    edits = " ".join(f"-e 's/^{key} .*/{key} = {value}/'" for key, value in limits.items())
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/bash\nif [ "$1 $2" = "show config" ]; then\n  {real} "$@" | sed {edits}\n'
                      f'  exit "${{PIPESTATUS[0]}}"\nfi\nexec {real} "$@"\n')
    script.chmod(0o755)
    return bin_dir


def limiting_partition(bin_dir: Path, max_time: str) -> Path:
    """The real scontrol and sbatch, except that ``show partition`` reports ``MaxTime=max_time``;
    each call of either is appended to ``bin_dir/calls.log`` (its arguments). Returns the log."""
    log = bin_dir / "calls.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("scontrol", "sbatch"):
        real = shutil.which(name)
        assert real is not None, f"{name} is not on PATH"
        edit = (f'if [ "$1 $2" = "show partition" ]; then\n  {real} "$@" | sed -e "s/MaxTime=[^ ]*/'
                f'MaxTime={max_time}/"\n  exit "${{PIPESTATUS[0]}}"\nfi\n') if name == "scontrol" else ""
        script = bin_dir / name
        script.write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\n{edit}exec {real} "$@"\n')
        script.chmod(0o755)
    return log
