"""Manifest.attributes and the dataset's extra files (a tokenizer.json): optional, backward
compatible (absent from the file and the fingerprint when empty), owned by the dataset, verified."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from sharding import CorruptDatasetError, DatasetError, DatasetWriter, open_dataset, verify
from sharding.format import MANIFEST_NAME, foreign_files, read_manifest
from sharding.writer import check_output

SAMPLES = [{"x": np.arange(k, dtype=np.int32)} for k in range(4)]


def _write(path: Path, attributes: dict | None = None, files: dict[str, bytes] | None = None,
           **kwargs: object) -> Path:
    with DatasetWriter(path, attributes=attributes, **kwargs) as writer:  # type: ignore[arg-type]
        for name, data in (files or {}).items():
            writer.add_file(name, data)
        for sample in SAMPLES:
            writer.append(sample)
    return path


def _old_fingerprint(path: Path) -> str:
    """The fingerprint as documented before attributes existed (docs/format.md)."""
    doc = json.loads((path / MANIFEST_NAME).read_text())
    return xxhash.xxh3_64_hexdigest(json.dumps({
        "schema": [[f["name"], f["dtype"], f["shape"]] for f in doc["fields"]],
        "shards": [[s["num_samples"], s["data_xxh3_64"], s["index_xxh3_64"]]
                   for s in doc["shards"]]}, sort_keys=True).encode())


def test_a_dataset_without_attributes_has_the_manifest_and_fingerprint_it_always_had(tmp_path):
    path = _write(tmp_path / "ds")
    doc = json.loads((path / MANIFEST_NAME).read_text())
    assert "attributes" not in doc and "files" not in doc
    assert open_dataset(path).fingerprint == _old_fingerprint(path)
    assert dict(open_dataset(path).attributes) == {}


def test_attributes_and_files_round_trip_through_the_reader(tmp_path):
    attributes = {"tokenizer": {"kind": "bpe", "vocab_size": 300, "eos_id": 0,
                                "file": "tokenizer.json"}, "pair": (1, 2)}
    path = _write(tmp_path / "ds", attributes, {"tokenizer.json": b'{"model": 1}'})
    ds = open_dataset(path)
    expected = {**attributes, "pair": [1, 2]}  # as JSON reads it back
    assert dict(ds.attributes) == ds.manifest.attributes == expected
    assert read_manifest(path).attributes == expected
    (info,) = ds.manifest.files
    assert (info.name, info.num_bytes) == ("tokenizer.json", 12)
    assert (path / "tokenizer.json").read_bytes() == b'{"model": 1}'
    assert ds.fingerprint != _old_fingerprint(path)  # a dataset with attributes: they count
    assert verify(path) == []


def test_attributes_may_be_set_until_close(tmp_path):
    with DatasetWriter(tmp_path / "ds") as writer:
        for sample in SAMPLES:
            writer.append(sample)
        writer.attributes["num_documents"] = writer.num_samples
    assert open_dataset(tmp_path / "ds").attributes == {"num_documents": 4}


def test_the_fingerprint_changes_with_the_attributes_and_the_files(tmp_path):
    a = open_dataset(_write(tmp_path / "a", {"classes": ["cat", "dog"]})).fingerprint
    b = open_dataset(_write(tmp_path / "b", {"classes": ["dog", "cat"]})).fingerprint
    c = open_dataset(_write(tmp_path / "c", {"classes": ["cat", "dog"]}, {"t.json": b"1"})).fingerprint
    d = open_dataset(_write(tmp_path / "d", {"classes": ["cat", "dog"]}, {"t.json": b"2"})).fingerprint
    assert len({a, b, c, d}) == 4


def test_attributes_json_cannot_hold_are_refused_and_nothing_is_published(tmp_path):
    with pytest.raises(DatasetError, match=r"attributes of .*ds cannot be stored as JSON"):
        _write(tmp_path / "ds", {"vocab_size": np.int64(3)})
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("name", ["manifest.json", "shard-00000.bin", "shard-7.idx", "../x",
                                  "a/b", ".lock", "", "tok.json"])
def test_extra_file_names_that_are_not_plain_or_are_taken_are_refused(tmp_path, name):
    with DatasetWriter(tmp_path / "ds") as writer:
        if name == "tok.json":
            writer.add_file(name, b"1")  # the second time is refused
        with pytest.raises(DatasetError, match=f"extra file name {name!r}"):
            writer.add_file(name, b"2")
        writer.append(SAMPLES[0])


def test_the_datasets_own_files_are_not_foreign_and_overwrite_replaces_them(tmp_path):
    path = _write(tmp_path / "ds", {"a": 1}, {"tokenizer.json": b"{}"})
    assert foreign_files(path) == []
    check_output(path, overwrite=True)  # no refusal
    _write(path, overwrite=True)  # the new dataset has no tokenizer.json
    assert not (path / "tokenizer.json").exists() and foreign_files(path) == []
    (path / "tokenizer.json").write_text("{}")  # not listed by this manifest: the user's
    assert foreign_files(path) == ["tokenizer.json"]
    with pytest.raises(DatasetError, match=r"'tokenizer\.json'"):
        check_output(path, overwrite=True)


def test_a_directory_named_like_an_extra_file_is_foreign(tmp_path):
    path = _write(tmp_path / "ds", {"a": 1}, {"tokenizer.json": b"{}"})
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").mkdir()
    assert foreign_files(path) == ["tokenizer.json"]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda doc: doc.update(attributes=[1]), "'attributes' is a list, expected a JSON object"),
    (lambda doc: doc.update(files=[{"name": "../t", "num_bytes": 1, "xxh3_64": "0"}]),
     "extra file name '../t' is not a plain file name"),
    (lambda doc: doc.update(files=[{"name": "shard-00000.bin", "num_bytes": 1, "xxh3_64": "0"}]),
     "extra file name 'shard-00000.bin' is the manifest's or a shard file's name"),
])
def test_a_manifest_with_bad_attributes_or_files_is_refused(tmp_path, edit, message):
    path = _write(tmp_path / "ds")
    doc = json.loads((path / MANIFEST_NAME).read_text())
    edit(doc)
    (path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptDatasetError, match=message):
        open_dataset(path)
