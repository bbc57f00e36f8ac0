"""Damaged datasets: open catches structure cheaply, verify catches every flipped byte.

Each test damages a real dataset on disk the way it happens in practice (a copy cut short, a
flipped bit, a foreign or newer file, a lost shard) and checks the error names file and shard.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from sharding import CorruptDatasetError, DatasetError, open_dataset, run_verify_cli, verify
from sharding.format import HEADER, MANIFEST_NAME


def _shard_files(path: Path, shard: int) -> tuple[Path, Path]:
    entry = json.loads((path / MANIFEST_NAME).read_text())["shards"][shard]
    return path / entry["data_file"], path / entry["index_file"]


def _truncate(path: Path, num_bytes: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - num_bytes)


def _flip_byte(path: Path, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.parametrize("which", [0, 1], ids=["data", "index"])
def test_truncated_file_fails_at_open_naming_file_and_shard(dataset_path, which):
    target = _shard_files(dataset_path, 2)[which]
    _truncate(target, 3)
    with pytest.raises(CorruptDatasetError, match=r"shard 2 .*truncated") as info:
        open_dataset(dataset_path)
    assert info.value.file == str(target) and info.value.shard == 2
    assert str(target) in str(info.value)


def test_flipped_data_byte_is_caught_by_verify(dataset_path, capsys):
    data, _ = _shard_files(dataset_path, 1)
    _flip_byte(data, 5)
    open_dataset(dataset_path)  # same size, valid index: only a checksum can tell
    problems = verify(dataset_path)
    assert [(p.file, p.shard) for p in problems] == [(str(data), 1)]
    assert "checksum" in problems[0].what
    assert run_verify_cli(str(dataset_path)) == 1
    report = capsys.readouterr().out
    assert "FAILED: 1 problem" in report and f"shard 1: {data}" in report


def test_flipped_index_array_byte_is_caught_by_verify(dataset_path):
    _, index = _shard_files(dataset_path, 0)
    _flip_byte(index, index.stat().st_size - 4)  # high bytes of the last leading size
    problems = verify(dataset_path)
    assert {(p.file, p.shard) for p in problems} == {(str(index), 0)}
    assert any("checksum" in p.what for p in problems)
    assert any("lies outside" in p.what for p in problems)  # structure check caught it too


def test_corrupt_offsets_fail_on_first_read_not_with_garbage(dataset_path):
    """An index that passes the size check but points outside the data fails when mapped."""
    _, index = _shard_files(dataset_path, 0)
    table_bytes = HEADER.unpack(index.read_bytes()[:HEADER.size])[7]
    with open(index, "r+b") as f:
        f.seek(HEADER.size + table_bytes)  # field 0's offset of local sample 0
        f.write(struct.pack("<q", 10**12))
    ds = open_dataset(dataset_path)
    with pytest.raises(CorruptDatasetError, match=r"shard 0 .*field 'x' of local sample 0 lies "
                                                  r"outside"):
        ds.sample(0)


def test_wrong_magic_fails_at_open(dataset_path):
    _, index = _shard_files(dataset_path, 3)
    _flip_byte(index, 1)
    with pytest.raises(CorruptDatasetError, match=r"shard 3 .*bad magic.*not a Switchyard index"):
        open_dataset(dataset_path)


def test_newer_format_version_fails_at_open_and_says_upgrade(dataset_path):
    _, index = _shard_files(dataset_path, 0)
    with open(index, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    with pytest.raises(CorruptDatasetError, match=r"shard 0 .*version 2 is not supported.*upgrade"):
        open_dataset(dataset_path)


def test_unknown_flags_fail_at_open(dataset_path):
    _, index = _shard_files(dataset_path, 0)
    with open(index, "r+b") as f:
        f.seek(12)
        f.write(struct.pack("<I", 0x103))
    with pytest.raises(CorruptDatasetError, match="flags 0x103"):
        open_dataset(dataset_path)


@pytest.mark.parametrize("which", [0, 1], ids=["data", "index"])
def test_missing_shard_file_fails_at_open_and_in_verify(dataset_path, which):
    target = _shard_files(dataset_path, 4)[which]
    target.unlink()
    with pytest.raises(CorruptDatasetError, match=r"shard 4 .*missing") as info:
        open_dataset(dataset_path)
    assert info.value.file == str(target)
    assert [(p.file, p.shard) for p in verify(dataset_path)] == [(str(target), 4)]


def test_swapped_shards_are_caught(dataset_path):
    """Two index files swapped: sizes may differ, and counts or checksums certainly do."""
    index_a, index_b = _shard_files(dataset_path, 0)[1], _shard_files(dataset_path, 1)[1]
    a, b = index_a.read_bytes(), index_b.read_bytes()
    index_a.write_bytes(b)
    index_b.write_bytes(a)
    assert {p.shard for p in verify(dataset_path)} == {0, 1}


def test_missing_or_broken_manifest(dataset_path, tmp_path):
    manifest = dataset_path / MANIFEST_NAME
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(CorruptDatasetError, match="manifest is invalid"):
        open_dataset(dataset_path)
    manifest.unlink()
    with pytest.raises(CorruptDatasetError, match=r"manifest is missing.*did not finish"):
        open_dataset(dataset_path)
    with pytest.raises(DatasetError, match="no dataset here"):
        open_dataset(tmp_path / "nothing")


def test_manifest_cannot_point_outside_its_directory(dataset_path):
    manifest = dataset_path / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc["shards"][0]["data_file"] = "../../etc/passwd"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptDatasetError, match="not a plain file name"):
        open_dataset(dataset_path)


def test_manifest_and_index_must_agree(dataset_path):
    manifest = dataset_path / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc["fields"][0]["dtype"] = "float64"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CorruptDatasetError, match=r"index schema .* differs from the manifest"):
        open_dataset(dataset_path)


def test_verify_reports_ok_on_a_good_dataset(dataset_path, capsys):
    assert verify(dataset_path) == []
    assert run_verify_cli(str(dataset_path)) == 0
    report = capsys.readouterr().out
    ds = open_dataset(dataset_path)
    assert report.startswith(f"OK: {len(ds)} samples in {len(ds.shard_counts)} shards, "
                             f"checksums match")


def test_verify_of_a_path_that_is_not_a_dataset(tmp_path, capsys):
    assert run_verify_cli(str(tmp_path / "missing")) == 1
    assert "no dataset here" in capsys.readouterr().out


def test_writes_through_a_view_never_reach_the_file(dataset_path):
    """Views are copy-on-write: a training loop that scribbles on a sample cannot corrupt data."""
    ds = open_dataset(dataset_path)
    i = next(k for k in range(len(ds)) if len(ds.sample(k)["x"]))
    ds.sample(i)["x"][:] = np.nan
    assert verify(dataset_path) == []
    assert not np.isnan(open_dataset(dataset_path).sample(i)["x"]).any()
