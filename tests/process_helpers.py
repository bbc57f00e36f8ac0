"""Looking at processes from a test (``pythonpath = tests``)."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether a process lives: a zombie (dead, its parent gone, not yet reaped by init) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
