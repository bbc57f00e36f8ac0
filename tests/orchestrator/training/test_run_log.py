"""The run log's rules on their own: what a resume drops, the flat config, the stable W&B id, and a
chosen backend that is not installed failing before submission."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, LoggerConfig
from orchestrator.training.run_log import check_available, drop_after, flatten, wandb_id


def test_a_resume_drops_the_lines_logged_after_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "train_loss": 1.0 / s} for s in (5, 10, 15, 20)] + [{"step": 10, "eval_loss": 2}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 25, "train_lo')
    drop_after(path, 10)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(k["step"], "eval_loss" in k) for k in kept] == [(5, False), (10, False), (10, True)]


def test_the_config_is_flattened_with_dotted_keys() -> None:
    assert flatten({"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "seed": 0, "x": None}) == {
        "optim.lr": 1e-3, "optim.betas": "[0.9, 0.95]", "seed": 0, "x": "None"}


def test_the_wandb_id_follows_the_run_directory(tmp_path: Path) -> None:
    assert wandb_id(tmp_path / "a") == wandb_id(tmp_path / "a") != wandb_id(tmp_path / "b")


def test_a_chosen_backend_that_is_not_installed_fails_before_submission(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets without the extra
    with pytest.raises(ConfigError, match=r"logger.wandb=true but wandb is not installed \(pip install "
                                          r"'switchyard\[wandb\]', or logger.wandb=false\)"):
        check_available(LoggerConfig(wandb=True))
    check_available(LoggerConfig(wandb=False))


def test_peak_memory_is_per_window_and_the_runs_peak_survives_the_resets(tmp_path: Path) -> None:
    """CPU: the kernel's peak RSS, reset per window (clear_refs); the GPU twin is in tests/gpu."""
    import numpy as np
    import torch

    from orchestrator.telemetry.files import record_rank_peak
    from orchestrator.training.metrics import WindowPeaks

    peaks = WindowPeaks(torch.device("cpu"))
    peaks.close_window()
    big = np.ones(40_000_000)  # 320 MB, touched
    del big
    busy = peaks.close_window()
    quiet = peaks.close_window()
    assert busy - quiet > 250e6, (busy, quiet)  # the second window did not see the first's peak
    assert peaks.run_peak() >= busy
    recorded = record_rank_peak(tmp_path, rank=0, device_index=None, floor=peaks.run_peaks())
    assert recorded["max_rss_bytes"] >= busy  # the telemetry's peak is the run's, not the window's


@pytest.fixture
def no_wandb_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No key anywhere W&B looks: a home without a netrc file, no W&B variables."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED",
                 "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_wandb_online_without_an_api_key_fails_before_submission(
        no_wandb_key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: wandb.init failed on rank 0, after the queue wait."""
    with pytest.raises(ConfigError) as refused:
        check_available(LoggerConfig(wandb=True))
    message = str(refused.value)
    for part in ("logger.wandb=true but W&B has no API key here", "WANDB_API_KEY", "`wandb login`",
                 "WANDB_MODE=offline", "logger.wandb=false"):
        assert part in message, message
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "k" * 40)):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            check_available(LoggerConfig(wandb=True))
    (no_wandb_key / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    (no_wandb_key / ".netrc").chmod(0o600)
    check_available(LoggerConfig(wandb=True))  # what `wandb login` writes
