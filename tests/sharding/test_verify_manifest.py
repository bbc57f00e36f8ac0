"""verify checks every figure of the manifest against the shards, not only the checksums: a manifest
edited by hand (or by a bad copy tool) with consistent checksums is still caught, field by field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sharding import DatasetWriter, verify


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


@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: field("x")(m).update(max_leading=4),
     "field 'x': the manifest's min_leading/max_leading 1/4 differ from the index's 1/5"),
    (lambda m: field("x")(m).update(min_leading=1, max_leading=1),
     "field 'x': the manifest's min_leading/max_leading 1/1 differ from the index's 1/5"),
    (lambda m: field("y")(m).update(max_value=9),
     "field 'y': the manifest's min_value/max_value 0/9 differ from the data's 0/2"),
    (lambda m: m.update(shard_bytes=512),
     "shard 0: {manifest}: data_bytes"),
])
def test_a_manifest_figure_that_differs_from_the_shards_is_named(
        tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: str) -> None:
    path = dataset(tmp_path / "ds")
    assert verify(path) == []
    edit(path, change)
    problems = [str(p) for p in verify(path)]
    assert any(expected.format(manifest=path / "manifest.json") in p for p in problems), problems
