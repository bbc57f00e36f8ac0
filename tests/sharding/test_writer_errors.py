"""Every way a write can go wrong publishes nothing and says what to fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sharding import DatasetError, DatasetWriter, SchemaMismatchError, open_dataset
from sharding.format import FieldSpec


def _good(i: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros((i % 3, 4), np.float32), "y": np.int64(i)}


@pytest.mark.parametrize(("bad", "expected", "actual"), [
    ({"x": np.zeros((2, 4), np.float64), "y": np.int64(0)}, "float32[*, 4]", "float64[2, 4]"),
    ({"x": np.zeros((2, 5), np.float32), "y": np.int64(0)}, "float32[*, 4]", "float32[2, 5]"),
    ({"x": np.zeros(4, np.float32), "y": np.int64(0)}, "float32[*, 4]", "float32[4]"),
    ({"x": np.zeros((1, 4), np.float32), "y": np.zeros(1, np.int64)}, "int64[]", "int64[1]"),
])
def test_schema_mismatch_names_sample_field_expected_and_actual(tmp_path, bad, expected, actual):
    field = "y" if "int64" in expected else "x"
    with DatasetWriter(tmp_path / "ds") as writer:
        for i in range(3):
            writer.append(_good(i))
        with pytest.raises(SchemaMismatchError) as info:
            writer.append(bad)
        message = str(info.value)
        assert f"sample 3, field {field!r}" in message
        assert f"expected {expected}, got {actual}" in message
        assert (info.value.sample, info.value.field) == (3, field)
        writer.append(_good(3))  # a refused sample wrote nothing: the writer goes on
    ds = open_dataset(tmp_path / "ds")
    assert len(ds) == 4 and int(ds.sample(3)["y"]) == 3


def test_missing_and_extra_fields_are_named(tmp_path):
    with DatasetWriter(tmp_path / "ds") as writer:
        writer.append(_good(0))
        with pytest.raises(SchemaMismatchError, match="sample 1, field 'y': missing"):
            writer.append({"x": np.zeros((1, 4), np.float32)})
        with pytest.raises(SchemaMismatchError, match="sample 1, field 'z': not in the schema"):
            writer.append({**_good(1), "z": np.zeros(1)})
        with pytest.raises(SchemaMismatchError, match="sample 1 is a list, expected a mapping"):
            writer.append([np.zeros(1)])  # type: ignore[arg-type]


def test_explicit_schema_checks_the_first_sample_too(tmp_path):
    writer = DatasetWriter(tmp_path / "ds", schema={"x": FieldSpec("int16", (None,))})
    with pytest.raises(SchemaMismatchError,
                       match=r"sample 0, field 'x': expected int16\[\*\], got int64\[3\]"):
        writer.append({"x": np.zeros(3, np.int64)})
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.array([object()]),
                                   np.zeros(2, np.longdouble)])
def test_unsupported_dtypes_are_refused_by_name(tmp_path, value):
    writer = DatasetWriter(tmp_path / "ds")
    with pytest.raises(SchemaMismatchError,
                       match=r"sample 0, field 'x': dtype .* is not supported"):
        writer.append({"x": value})
    writer.abort()


def test_invalid_field_specs_are_refused():
    with pytest.raises(DatasetError, match="not supported"):
        FieldSpec("float128", (None,))
    with pytest.raises(DatasetError, match="shape"):
        FieldSpec("float32", (3, 4))


def test_a_sample_larger_than_a_shard_is_refused(tmp_path):
    with DatasetWriter(tmp_path / "ds", shard_bytes=64) as writer:
        writer.append({"x": np.zeros(8, np.float32)})
        with pytest.raises(DatasetError, match=r"sample 1 is 128 bytes, more than shard_bytes=64"):
            writer.append({"x": np.zeros(32, np.float32)})


def test_output_that_exists_is_refused_before_any_work(tmp_path):
    (tmp_path / "ds").mkdir()
    with pytest.raises(DatasetError, match=r"already exists.*overwrite=true"):
        DatasetWriter(tmp_path / "ds")
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temp directory either


def test_overwrite_replaces_a_dataset_atomically(write_dataset, tmp_path):
    write_dataset([_good(i) for i in range(5)])
    write_dataset([_good(i) for i in range(2)], overwrite=True)
    assert len(open_dataset(tmp_path / "ds")) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # the old copy is gone


def test_overwrite_never_deletes_a_directory_that_is_not_a_dataset(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(DatasetError, match="is not a dataset"):
        DatasetWriter(precious, overwrite=True)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_exception_inside_the_with_block_publishes_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), DatasetWriter(tmp_path / "ds",
                                                                  shard_bytes=64) as writer:
        for i in range(50):  # several finished shards already exist in the temp directory
            writer.append(_good(i))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_uncaught_schema_error_publishes_nothing(tmp_path):
    with pytest.raises(SchemaMismatchError), DatasetWriter(tmp_path / "ds") as writer:
        writer.append(_good(0))
        writer.append({"x": "not an array of floats", "y": np.int64(1)})
    assert list(tmp_path.iterdir()) == []


def test_closing_an_empty_writer_publishes_nothing(tmp_path):
    with pytest.raises(DatasetError, match="no samples were written"), DatasetWriter(
            tmp_path / "ds"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_killed_writer_leaves_no_dataset(tmp_path):
    """A crash mid-write (os._exit: no cleanup at all) leaves only a hidden temp directory."""
    script = (
        "import os, numpy as np\n"
        "from sharding import DatasetWriter\n"
        f"w = DatasetWriter({str(tmp_path / 'ds')!r}, shard_bytes=64)\n"
        "for i in range(40): w.append({'x': np.zeros(5)})\n"
        "os._exit(9)\n"
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not (tmp_path / "ds").exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ds.tmp-")
    with pytest.raises(DatasetError, match="manifest is missing"):
        open_dataset(leftovers[0])


def test_a_closed_writer_refuses_more_samples(tmp_path):
    writer = DatasetWriter(tmp_path / "ds")
    writer.append(_good(0))
    assert writer.close() == tmp_path / "ds"
    with pytest.raises(DatasetError, match="closed"):
        writer.append(_good(1))


def test_published_directory_mode_follows_the_umask(tmp_path: Path):
    """Not mkdtemp's 0700, which would hide a shared dataset from every other user."""
    writer = DatasetWriter(tmp_path / "ds")
    writer.append(_good(0))
    out = writer.close()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
