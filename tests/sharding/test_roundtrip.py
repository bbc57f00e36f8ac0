"""Writer -> reader round trips: fields, shapes, dtypes, shard rolling, the small reader API."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sharding import DatasetError, DatasetWriter, FieldSpec, open_dataset
from sharding.format import MANIFEST_NAME, SUPPORTED_DTYPES


def test_round_trip_keeps_fields_shapes_and_dtypes(write_dataset, mixed_samples, samples_equal):
    ds = open_dataset(write_dataset(mixed_samples))
    assert len(ds) == len(mixed_samples)
    for i, expected in enumerate(mixed_samples):
        samples_equal(ds.sample(i), expected)
    assert ds.sample(1)["x"].shape == (0, 4)  # a 0-row sample keeps its trailing shape
    assert ds.sample(3)["y"].shape == ()  # a scalar stays 0-d


def test_schema_comes_from_the_first_sample(write_dataset, mixed_samples):
    ds = open_dataset(write_dataset(mixed_samples))
    assert dict(ds.schema) == {
        "x": FieldSpec("float32", (None, 4)),
        "y": FieldSpec("int64", ()),
        "tokens": FieldSpec("int32", (None,)),
    }
    assert str(ds.schema["x"]) == "float32[*, 4]" and str(ds.schema["y"]) == "int64[]"
    assert ds.fixed_fields == frozenset({"y"})
    rows = [len(s["x"]) for s in mixed_samples]
    assert (ds.field_stats["x"].min_leading, ds.field_stats["x"].max_leading) == (
        min(rows), max(rows))


def test_getitem_returns_tensors_of_the_same_values(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    item = ds[5]
    assert all(isinstance(t, torch.Tensor) for t in item.values())
    np.testing.assert_array_equal(item["x"].numpy(), mixed_samples[5]["x"])
    assert item["y"].dim() == 0 and int(item["y"]) == int(mixed_samples[5]["y"])


def test_shards_roll_at_shard_bytes(write_dataset, make_samples):
    samples = make_samples(400)
    path = write_dataset(samples, shard_bytes=512)
    ds = open_dataset(path)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert len(ds.shard_counts) >= 20
    assert sum(ds.shard_counts) == len(ds) == 400
    assert list(ds.shard_counts) == [s["num_samples"] for s in manifest["shards"]]
    for shard in manifest["shards"]:
        assert 0 < (path / shard["data_file"]).stat().st_size <= 512
    # Global index = position in the concatenation of shards in manifest order.
    for i in (0, 399, int(np.cumsum(ds.shard_counts)[3]), 123):
        np.testing.assert_array_equal(ds.sample(i)["tokens"], samples[i]["tokens"])


def test_each_field_starts_8_byte_aligned(write_dataset):
    samples = [{"a": np.ones(n, np.int8), "b": np.float64(n)} for n in range(9)]
    ds = open_dataset(write_dataset(samples))
    for i in range(len(ds)):
        for name, view in ds.sample(i).items():
            assert view.ctypes.data % 8 == 0, (i, name)


def test_explicit_schema_and_every_supported_dtype(write_dataset, samples_equal):
    schema = {name: FieldSpec(name, (None, 2)) for name in SUPPORTED_DTYPES}
    rng = np.random.default_rng(3)
    samples = [{name: (rng.random((k, 2)) * 100).astype(name) for name in SUPPORTED_DTYPES}
               for k in (0, 1, 3)]
    ds = open_dataset(write_dataset(samples, schema=schema))
    assert dict(ds.schema) == schema
    for i, expected in enumerate(samples):
        samples_equal(ds.sample(i), expected)


def test_big_endian_input_is_stored_little_endian(write_dataset):
    big = np.arange(6, dtype=">i4").reshape(3, 2)
    ds = open_dataset(write_dataset([{"x": big}]))
    got = ds.sample(0)["x"]
    assert got.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got, big)


def test_torch_tensors_and_python_scalars_are_accepted(write_dataset):
    ds = open_dataset(write_dataset([{"x": torch.arange(6.0).reshape(2, 3), "y": 5}]))
    np.testing.assert_array_equal(ds.sample(0)["x"], np.arange(6.0).reshape(2, 3))
    assert ds.sample(0)["y"] == 5


def test_negative_and_out_of_range_indices(dataset_path):
    ds = open_dataset(dataset_path)
    np.testing.assert_array_equal(ds.sample(-1)["tokens"], ds.sample(len(ds) - 1)["tokens"])
    np.testing.assert_array_equal(ds.sample(np.int64(2))["x"], ds.sample(2)["x"])
    for bad in (len(ds), -len(ds) - 1):
        with pytest.raises(IndexError, match=f"sample index {bad} is out of range"):
            ds.sample(bad)


def test_locate_is_the_vectorized_index_map(dataset_path):
    ds = open_dataset(dataset_path)
    idx = np.arange(len(ds))
    shards, local = ds.locate(idx)
    starts = np.concatenate([[0], np.cumsum(ds.shard_counts)[:-1]])
    np.testing.assert_array_equal(starts[shards] + local, idx)
    assert (local < np.asarray(ds.shard_counts)[shards]).all()
    with pytest.raises(IndexError, match=str(len(ds))):
        ds.locate(np.array([0, len(ds)]))


def test_spans_locate_each_samples_bytes(dataset_path, mixed_samples):
    """What the batched loader copies from: the bytes of each sample's field, in any shard."""
    ds = open_dataset(dataset_path)
    some = np.array([59, 0, 31, 31, 7, 58, 1])  # sample 1 has 0 rows
    assert len(set(ds.locate(some)[0].tolist())) > 2  # several shards in one call
    sources, spans = ds.spans(some, list(mixed_samples[0]))  # every field, located once
    assert list(spans) == list(mixed_samples[0])
    for name, (starts, leading) in spans.items():
        for k, i in enumerate(some.tolist()):
            want = np.ascontiguousarray(mixed_samples[i][name])
            row = want.nbytes // max(len(want), 1) if want.ndim else want.nbytes
            assert leading[k] == (len(want) if want.ndim else 1)
            got = sources[k][starts[k] : starts[k] + leading[k] * row]
            assert got.tobytes() == want.astype(want.dtype.newbyteorder("<")).tobytes(), (name, i)
    with pytest.raises(DatasetError, match="'nope' is not in the dataset"):
        ds.spans(some, ["x", "nope"])
    with pytest.raises(IndexError, match="out of range"):
        ds.spans(np.array([len(ds)]), ["x"])


def test_leading_sizes_for_all_and_for_some(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    expected = np.array([len(s["x"]) for s in mixed_samples])
    np.testing.assert_array_equal(ds.leading_sizes("x"), expected)
    some = np.array([59, 0, 31, 31, 7])
    np.testing.assert_array_equal(ds.leading_sizes("x", some), expected[some])
    assert ds.open_shards == ()  # leading sizes come from index files only, no data map
    with pytest.raises(DatasetError, match="'y' is a scalar"):
        ds.leading_sizes("y")
    with pytest.raises(DatasetError, match="'nope' is not in the dataset"):
        ds.leading_sizes("nope")


def test_read_into_copies_one_field_into_a_padded_row(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    batch = np.full((3, 8, 4), -1.0, np.float32)
    for row, i in enumerate((4, 1, 9)):
        n = ds.read_into(i, "x", batch[row])
        assert n == len(mixed_samples[i]["x"])
        np.testing.assert_array_equal(batch[row, :n], mixed_samples[i]["x"])
        assert (batch[row, n:] == -1.0).all()  # rows past n untouched
    labels = np.zeros(3, np.int64)
    assert ds.read_into(9, "y", labels[2, ...]) == 1
    assert labels[2] == mixed_samples[9]["y"]


def test_read_into_refuses_a_wrong_buffer(dataset_path, mixed_samples):
    ds = open_dataset(dataset_path)
    i = next(k for k, s in enumerate(mixed_samples) if len(s["x"]) >= 2)
    cases = [np.zeros((8, 4), np.float64), np.zeros((8, 5), np.float32),
             np.zeros((1, 4), np.float32)]
    for out in cases:
        with pytest.raises(DatasetError, match=f"sample {i}, field 'x'.*must be float32"):
            ds.read_into(i, "x", out)
    with pytest.raises(DatasetError, match="0-d array"):
        ds.read_into(i, "y", np.zeros(1, np.int64))
    with pytest.raises(DatasetError, match="'z' is not in the dataset"):
        ds.read_into(i, "z", np.zeros(1))


def test_fingerprint_is_stable_and_tracks_content(write_dataset, make_samples):
    a = open_dataset(write_dataset(make_samples(20), name="a"))
    b = open_dataset(write_dataset(make_samples(20), name="b"))
    c = open_dataset(write_dataset(make_samples(20, seed=1), name="c"))
    assert a.fingerprint == b.fingerprint == open_dataset(a.root).fingerprint
    assert a.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 16


def test_repr_names_path_counts_and_schema(dataset_path):
    text = repr(open_dataset(dataset_path))
    assert str(dataset_path) in text and "60 samples" in text and "x: float32[*, 4]" in text


def test_writer_publishes_only_at_close(tmp_path: Path):
    path = tmp_path / "ds"
    with DatasetWriter(path) as writer:
        writer.append({"x": np.zeros(3)})
        assert not path.exists()
        assert [p.name.startswith(".ds.tmp-") for p in tmp_path.iterdir()] == [True]
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    assert open_dataset(path).shard_counts == (1,)
