"""The CUDA paths of a rank's start, on a CPU machine: torch.cuda faked where a GPU would answer.

Each test pins what a GPU run needs (which device, which backend, which setting) and fails on the
mistake it guards against; ``make gpu-check`` runs the real thing on a GPU node.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from orchestrator.training import runtime


def fake_gpus(monkeypatch: pytest.MonkeyPatch, uuids: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))


def test_cuda_uuids_are_read_from_cuda_in_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, ["cccc", "aaaa"])
    assert runtime.cuda_uuids(gpus_per_node=2) == ["cccc", "aaaa"]
    assert runtime.cuda_uuids(gpus_per_node=0) is None  # a CPU run never starts CUDA
    assert runtime.device_uuid(["cccc", "aaaa"], 1) == "aaaa"
    assert runtime.device_uuid(None, 1) is None and runtime.device_uuid(["cccc"], None) is None
