"""Properties over random schemas: whatever is written reads back exactly, shard by shard."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharding import DatasetWriter, FieldSpec, open_dataset, verify
from sharding.format import (
    SUPPORTED_DTYPES,
    CorruptDatasetError,
    decode_index_head,
    encode_index_head,
    index_bytes_for,
    pad8,
)

FIELD_SPECS = st.builds(
    FieldSpec,
    dtype=st.sampled_from(SUPPORTED_DTYPES),
    shape=st.one_of(st.just(()), st.lists(st.integers(0, 3), max_size=3).map(
        lambda dims: (None, *dims))),
)
SCHEMAS = st.dictionaries(st.text(min_size=1, max_size=12), FIELD_SPECS, min_size=1, max_size=4)


def _random_array(spec: FieldSpec, rows: int, rng: np.random.Generator) -> np.ndarray:
    shape = () if spec.is_scalar else (rows, *spec.trailing)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * spec.np_dtype.itemsize, dtype=np.uint8)
    a = raw.view(spec.np_dtype).reshape(shape)  # arbitrary bit patterns, NaNs included
    return a.copy()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, rows=st.lists(st.integers(0, 5), min_size=1, max_size=25),
       extra_bytes=st.integers(0, 2048), seed=st.integers(0, 2**32))
def test_round_trip_over_random_schemas(schema, rows, extra_bytes, seed):
    rng = np.random.default_rng(seed)
    samples = [{n: _random_array(s, r, rng) for n, s in schema.items()} for r in rows]
    # From one sample per shard (the largest just fits) to many.
    shard_bytes = max(sum(pad8(a.nbytes) for a in s.values()) for s in samples) + extra_bytes
    shard_bytes = max(shard_bytes, 8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        with DatasetWriter(path, shard_bytes=shard_bytes) as writer:
            for sample in samples:
                writer.append(sample)
        ds = open_dataset(path)
        assert dict(ds.schema) == schema and len(ds) == len(samples)
        assert sum(ds.shard_counts) == len(samples)
        for i, expected in enumerate(samples):
            got = ds.sample(i)
            for name, want in expected.items():
                assert got[name].dtype == want.dtype and got[name].shape == want.shape
                # Compare bytes: NaN != NaN would fail a value comparison of identical data.
                assert got[name].tobytes() == want.tobytes()
        for name, spec in schema.items():
            if not spec.is_scalar:
                assert ds.leading_sizes(name).tolist() == rows
        assert verify(path) == []


@given(schema=SCHEMAS, num_samples=st.integers(0, 10**12), data_bytes=st.integers(0, 2**62))
def test_index_header_round_trips_and_has_its_exact_size(schema, num_samples, data_bytes):
    head = encode_index_head(schema, num_samples, data_bytes)
    assert len(head) % 8 == 0  # the arrays after it start 8-byte aligned
    header = decode_index_head(head, "x.idx", 0)
    assert header.schema == schema
    assert (header.num_samples, header.data_bytes) == (num_samples, data_bytes)
    assert header.index_bytes == index_bytes_for(schema, num_samples)
    assert header.arrays_offset == len(head)


@given(schema=SCHEMAS, cut=st.integers(0, 63))
def test_any_truncated_header_is_refused(schema, cut):
    head = encode_index_head(schema, 3, 64)
    with pytest.raises(CorruptDatasetError, match=r"x\.idx"):
        decode_index_head(head[:cut], "x.idx", 0)


@given(st.integers(0, 2**40))
def test_pad8(n):
    assert pad8(n) % 8 == 0 and 0 <= pad8(n) - n < 8
