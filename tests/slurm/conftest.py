"""What every test against the real cluster shares: the jobs it queued are cancelled at its end."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def queued() -> Iterator[list[str]]:
    """SLURM job ids a test queued: cancelled at the end, passed or failed, so no job holds the two
    nodes for the tests after it."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, check=False)
