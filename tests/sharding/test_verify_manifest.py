"""verify checks every figure of the manifest against the shards, not only the checksums: a manifest
edited by hand (or by a bad copy tool) with consistent checksums is still caught, field by field."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sharding import DatasetWriter, verify

verify_module = importlib.import_module("sharding.verify")  # the package exports the function


def dataset(path: Path) -> Path:
    with DatasetWriter(path, shard_bytes=4096) as writer:
        for i in range(40):
            writer.append({"x": np.ones((1 + i % 5, 8), np.float32), "y": np.int64(i % 3)})
    return path


def edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def field(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda m: next(f for f in m["fields"] if f["name"] == name)


def only_shard(m: dict[str, Any]) -> dict[str, Any]:
    return m["shards"][0]  # type: ignore[no-any-return]


def drop_last_shard(m: dict[str, Any]) -> None:
    m["num_samples"] -= m["shards"].pop()["num_samples"]


def list_shard_0_twice(m: dict[str, Any]) -> None:
    m["shards"].append(dict(m["shards"][0]))  # every file still listed: only the repeat is wrong
    m["num_samples"] += m["shards"][0]["num_samples"]


# Each case edits one figure so that every file's size and checksum still match the manifest: only
# the check named in the case can see it. Before each check existed, verify passed, crashed, or (for
# the last three) named neither the field nor both values.
@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: field("x")(m).update(max_leading=4),
     "shard 0: {root}/shard-00000.idx: field 'x': leading sizes 1..5 in this index file, outside the "
     "manifest's min_leading/max_leading 1/4"),
    (lambda m: field("x")(m).update(max_leading=6),
     "{root}/manifest.json: field 'x': the manifest's min_leading/max_leading 1/6 differ from the "
     "index's 1/5"),
    (lambda m: field("y")(m).update(max_value=1),
     "shard 0: {root}/shard-00000.bin: field 'y': values 0..2 in this data file, outside the manifest's "
     "min_value/max_value 0/1"),
    (lambda m: field("y")(m).update(max_value=9),
     "{root}/manifest.json: field 'y': the manifest's min_value/max_value 0/9 differ from the data's 0/2"),
    (lambda m: m.update(shard_bytes=512),
     "shard 0: {root}/manifest.json: data_bytes"),
    (drop_last_shard,
     "{root}/shard-00001.bin: not listed in the manifest (1 shards, "),
    (list_shard_0_twice,
     "shard 2: {root}/manifest.json: data_file 'shard-00000.bin' is also shard 0's: its samples would be "
     "read twice"),
    (lambda m: field("y")(m).update(min_leading=1, max_leading=1),
     "{root}/manifest.json: field 'y': the manifest records min_leading/max_leading for a scalar (int64[])"),
    (lambda m: field("x")(m).update(min_value=0, max_value=1),
     "{root}/manifest.json: field 'x': the manifest records min_value/max_value for float32[*, 8]; only "
     "integer scalar fields have them"),
    (lambda m: (only_shard(m).update(num_samples=only_shard(m)["num_samples"] + 1),
                m.update(num_samples=m["num_samples"] + 1)),
     "shard 0: {root}/shard-00000.idx: num_samples {n0} in the index header, {n0_plus_1} in the manifest"),
    (lambda m: field("x")(m).update(dtype="int32"),
     "shard 0: {root}/shard-00000.idx: index schema {{x: float32[*, 8], y: int64[]}} differs from the "
     "manifest's {{x: int32[*, 8], y: int64[]}}: field 'x' is float32[*, 8] in the index, int32[*, 8] in "
     "the manifest"),
    (lambda m: m.update(num_samples=m["num_samples"] + 1),
     "{root}/manifest.json: manifest is invalid: num_samples 41 != the shards' sum 40"),
])
def test_a_manifest_figure_that_differs_from_the_shards_is_named(
        tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: str) -> None:
    path = dataset(tmp_path / "ds")
    assert verify(path) == []
    n0 = json.loads((path / "manifest.json").read_text())["shards"][0]["num_samples"]
    edit(path, change)
    problems = [str(p) for p in verify(path)]
    wanted = expected.format(root=path, n0=n0, n0_plus_1=n0 + 1)
    assert any(p.startswith(wanted) for p in problems), problems


def test_every_shard_whose_figures_lie_outside_the_manifests_is_named(tmp_path: Path) -> None:
    path = dataset(tmp_path / "ds")
    edit(path, lambda m: field("x")(m).update(max_leading=1))  # 2..5 rows occur in every shard
    problems = verify(path)
    assert [p.shard for p in problems] == [0, 1] and {p.file for p in problems} == {
        str(path / "shard-00000.idx"), str(path / "shard-00001.idx")}


@pytest.mark.parametrize("path_taken", ["quick", "full"])
def test_each_shards_figures_are_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         path_taken: str) -> None:
    """Every shard's figures come from its own samples, on the quick path (small shards, one read)
    and on the full one (shards too large for the buffer), which finds each shard's samples."""
    if path_taken == "full":
        monkeypatch.setattr(verify_module, "_quick_shard", lambda *args: None)
    path = tmp_path / "ds"
    with DatasetWriter(path, shard_bytes=2048) as writer:  # rows grow with i: each shard its own range
        for i in range(60):
            writer.append({"x": np.ones((1 + i // 10, 8), np.float32), "y": np.int64(i // 20)})
    counts = [s["num_samples"] for s in json.loads((path / "manifest.json").read_text())["shards"]]
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    ranges = [(1 + a // 10, 1 + (a + n - 1) // 10) for a, n in zip(starts, counts, strict=True)]
    assert len(counts) >= 3 and verify(path) == []
    edit(path, lambda m: field("x")(m).update(max_leading=2))
    named = {p.shard: str(p) for p in verify(path) if p.shard is not None}
    assert named.keys() == {k for k, (_, hi) in enumerate(ranges) if hi > 2}
    for k, message in named.items():
        assert f"leading sizes {ranges[k][0]}..{ranges[k][1]} in this index file" in message
