"""open_dataset and verify cost the bytes, not a Python object per shard (issue 17, item 5): a
healthy shard is checked from one read of each file, compared with what the manifest implies;
anything that differs goes through the full checks, which name the problem as before."""

import importlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

from sharding import CorruptDatasetError, open_dataset, verify
from sharding.format import MANIFEST_NAME, file_checksum, read_index_head, read_manifest

reader = importlib.import_module("sharding.reader")
format_module = importlib.import_module("sharding.format")


def rewrite_index(path: Path, shard: int, *, byte: int | None = None) -> None:
    """Change shard's index (one offset past its data file, or one header byte) and record the
    new checksum in the manifest, so only the structure checks can tell."""
    manifest_path = path / MANIFEST_NAME
    doc = json.loads(manifest_path.read_text())
    entry = doc["shards"][shard]
    index = path / entry["index_file"]
    raw = bytearray(index.read_bytes())
    if byte is None:
        arrays_at = read_index_head(index, shard).arrays_offset
        past_the_end = np.int64(entry["data_bytes"] + 8).tobytes()
        raw[arrays_at : arrays_at + 8] = past_the_end  # the first sample's first field
    else:
        raw[byte] ^= 0x01
    index.write_bytes(bytes(raw))
    entry["index_xxh3_64"] = xxhash.xxh3_64_hexdigest(bytes(raw))
    manifest_path.write_text(json.dumps(doc))


def test_an_offset_outside_the_data_file_with_a_matching_checksum_is_named(dataset_path: Path) -> None:
    rewrite_index(dataset_path, 1)
    problems = verify(dataset_path)
    assert [p.shard for p in problems] == [1]
    assert "lies outside" in problems[0].what


def test_a_header_byte_changed_with_a_matching_checksum_is_named(dataset_path: Path) -> None:
    rewrite_index(dataset_path, 2, byte=8)  # the format version
    problems = verify(dataset_path)
    assert [p.shard for p in problems] == [2]
    assert "version" in problems[0].what
    with pytest.raises(CorruptDatasetError, match="version"):
        open_dataset(dataset_path)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(module, name)

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_a_healthy_dataset_is_opened_and_verified_without_a_map_or_decoded_header(
    dataset_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    num_shards = len(read_manifest(dataset_path).shards)
    assert num_shards > 3
    maps = count_calls(monkeypatch, reader, "_map_shard")
    heads = count_calls(monkeypatch, reader, "read_index_head")
    decoded = count_calls(monkeypatch, reader, "decode_index_head")
    open_dataset(dataset_path)
    assert verify(dataset_path) == []
    assert (len(maps), len(heads), len(decoded)) == (0, 0, 0)


def test_file_checksum_reuses_one_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "_BUFFERS", threading.local())  # this thread has none yet
    made = count_calls(monkeypatch, format_module.mmap, "mmap")
    for number in range(5):
        (tmp_path / f"f{number}").write_bytes(bytes([number]) * (3 << 20))
    digests = [file_checksum(tmp_path / f"f{number}") for number in range(5)]
    assert digests[1] == xxhash.xxh3_64_hexdigest(b"\x01" * (3 << 20))
    assert len(made) == 1  # the thread's buffer, made once: not 8 MiB allocated per file
