"""A torch below the floor is one `error:` line naming the version needed, not a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from train_helpers import run_train

from orchestrator.training import TorchVersionError, check_torch_version

REPO = Path(__file__).resolve().parents[2]


def test_jobs_train_under_torch_2_2_is_one_error_line(tmp_path: Path) -> None:
    """setup.cfg said torch>=2.2, but every run imports fully_shard, FSDPModule and get_total_norm
    (2.6): an old torch failed with an ImportError traceback deep in the strategy module."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.2.0"\n')  # no fully_shard, no distributed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = run_train(cwd=REPO, env=env, timeout=120, cold=True)  # a new interpreter imports the fake torch
    assert done.returncode != 0
    assert done.stderr.splitlines() == [
        "error: torch 2.2.0 is installed but Switchyard needs torch>=2.6 (fully_shard, FSDPModule, "
        "nn.utils.get_total_norm): install torch>=2.6 (the wheel matching your CUDA) before Switchyard"]


@pytest.mark.parametrize(("version", "too_old"), [
    ("2.2.0", True), ("2.5.1+cu124", True), ("1.13.1", True), ("2.6.0", False), ("2.13.0+cpu", False),
    ("2.7.0a0+git1234", False), ("3.0.0", False), ("local", False),
])
def test_torch_floor(version: str, too_old: bool) -> None:
    if too_old:
        with pytest.raises(TorchVersionError, match=rf"^torch {version.replace('+', '[+]')} is installed"):
            check_torch_version(version)
    else:
        check_torch_version(version)


def test_setup_cfg_states_the_same_floor() -> None:
    assert "    torch>=2.6\n" in (REPO / "setup.cfg").read_text()
