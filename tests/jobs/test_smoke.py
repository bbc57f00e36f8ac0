"""jobs.smoke: its tensor goes where the backend can move it, and the smoke test itself runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from jobs import smoke


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_nccl_smoke_test_reduces_on_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """It all-reduced a CPU tensor, which rides gloo beside NCCL: NCCL itself was never tested."""
    fake_gpus(monkeypatch, 8)
    assert smoke.smoke_device("nccl", 3) == torch.device("cuda", 3)
    assert smoke.smoke_device("auto", 5) == torch.device("cuda", 5)
    assert smoke.smoke_device("gloo", 5) == torch.device("cpu")
    fake_gpus(monkeypatch, 1)  # --gpus-per-task=1: the task's one GPU
    assert smoke.smoke_device("nccl", 3) == torch.device("cuda", 0)
    fake_gpus(monkeypatch, 2)
    with pytest.raises(RuntimeError, match=r"^local rank 3 has no GPU of its own: 2 visible"):
        smoke.smoke_device("nccl", 3)
    fake_gpus(monkeypatch, 0)
    assert smoke.smoke_device("auto", 0) == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"backend=nccl needs a GPU .*\(try backend=gloo\)"):
        smoke.smoke_device("nccl", 0)


def test_smoke_allreduce_on_one_cpu_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    result = smoke.allreduce(str(tmp_path), backend="gloo", rendezvous_timeout_s=30)
    assert (result["world_size"], result["backend"], result["reduced"]) == (1, "gloo", 1.0)
