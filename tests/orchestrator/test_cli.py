"""The installed `switchyard` console script, run as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.registry.db import Job, Registry
from sharding import DatasetWriter

SWITCHYARD = shutil.which("switchyard", path=str(Path(sys.executable).parent)) or "switchyard"


def test_verify_reports_ok_then_names_the_flipped_file(tmp_path: Path) -> None:
    with DatasetWriter(tmp_path / "ds", shard_bytes=1024) as writer:
        for i in range(40):
            writer.append({"x": np.full((i % 7, 8), i, np.float32), "y": np.int64(i)})
    ok = subprocess.run([SWITCHYARD, "verify", str(tmp_path / "ds")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("OK: 40 samples")

    victim = sorted((tmp_path / "ds").glob("*.bin"))[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = subprocess.run([SWITCHYARD, "verify", str(tmp_path / "ds")], capture_output=True, text=True)
    assert bad.returncode == 1
    assert victim.name in bad.stdout and "checksum" in bad.stdout.lower()


def test_cluster_needs_an_action() -> None:
    proc = subprocess.run([SWITCHYARD, "cluster"], capture_output=True, text=True)
    assert proc.returncode == 2 and "up" in proc.stderr


def to_a_reader_gone(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``switchyard ARGS | head -1``, head gone before the command writes: a pipe nobody reads."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([SWITCHYARD, *args], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["run", "--help"], ["status", "1"], ["status"]])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path, args: list[str]) -> None:
    """`switchyard status 1 | head -1` and `switchyard run --help | head -2` ended in a
    BrokenPipeError traceback: now exit 1 and nothing on stderr, as Python's docs recommend."""
    with Registry(tmp_path / "r.db") as reg:
        sweep_id = reg.create_sweep("train", "x=1,2", str(tmp_path), "local", "entry.pkl")
        reg.add_jobs(Job(sweep_id, n, [f"x={n}"], str(tmp_path / str(n)), {}, None) for n in range(2))
    registry = ["--registry", str(tmp_path / "r.db")] if args[0] == "status" else []
    proc = to_a_reader_gone([*args, *registry])
    assert (proc.returncode, proc.stderr) == (1, "")
