"""The installed `switchyard` console script, run as a user would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

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
