"""Atomic checkpoints: a crash mid-write leaves the previous one intact; unreadable ones are skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.training import checkpoint, resume


def test_save_keeps_the_last_k_and_leaves_no_temp_files(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, {"step": step}, keep_last=2)
    assert [s for s, _ in checkpoint.listed(tmp_path)] == [40, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000030.pt", "step-000000030.pt.xxh3",
                                                          "step-000000040.pt", "step-000000040.pt.xxh3"]


def test_a_crash_while_writing_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint.save(tmp_path, 10, {"step": 10, "w": torch.ones(3)}, keep_last=2)

    def dies_halfway(obj: object, f: object) -> None:
        f.write(b"PK\x03\x04 partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(checkpoint.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 20, {"step": 20}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010.pt", "step-000000010.pt.xxh3"]
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 10


def test_truncated_newest_falls_back_to_the_previous_and_says_so(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 10, {"step": 10}, keep_last=3)
    newest = checkpoint.save(tmp_path, 20, {"step": 20, "w": torch.zeros(1000)}, keep_last=3)
    newest.write_bytes(newest.read_bytes()[:100])
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 10
    assert found.skipped and found.skipped[0].startswith("step-000000020.pt")


def test_bytes_changed_inside_the_newest_fall_back_to_the_previous(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 10, {"step": 10, "w": torch.ones(4096)}, keep_last=3)
    newest = checkpoint.save(tmp_path, 20, {"step": 20, "w": torch.ones(4096)}, keep_last=3)
    data = bytearray(newest.read_bytes())
    at = data.index(torch.ones(4096).numpy().tobytes()[:64])  # inside the tensor's bytes
    data[at:at + 512] = b"\xff" * 512  # still a valid zip, and torch.load reads it: NaNs, silently
    newest.write_bytes(bytes(data))
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 10 and found.verified
    assert "step-000000020.pt: CheckpointError: checksum mismatch" in found.skipped[0]


def test_a_checkpoint_without_a_checksum_is_used_unverified(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, 10, {"step": 10}, keep_last=3)
    checkpoint.checksum_path(path).unlink()  # as written by a Switchyard before checksums
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 10 and not found.verified


def test_no_readable_checkpoint_at_all_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "step-000000005.pt").write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match=r"no readable checkpoint.*step-000000005\.pt"):
        checkpoint.load_latest(tmp_path)


def test_empty_directory_means_a_fresh_start(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_loading_maps_to_cpu(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, {"step": 1, "w": torch.ones(2)}, keep_last=1)
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.state["w"].device.type == "cpu"


def test_incompatible_model_is_refused_with_the_difference(tmp_path: Path) -> None:
    saved = {"model": {"hidden_dim": 64}, "in_features": 16}
    with pytest.raises(checkpoint.CheckpointError, match=r"model: checkpoint \{'hidden_dim': 64\}, now"):
        resume.check_compatible(saved, {"model": {"hidden_dim": 128}, "in_features": 16}, tmp_path)
    resume.check_compatible(saved, dict(saved), tmp_path)  # same shapes: fine
