"""slurm_query: id lists in chunks below the argument limit, failures reported, limits parsed.

sacct, squeue and scontrol are small scripts first on PATH here (tests/slurm_fakes.py): they
record what they were asked and answer, or fail, as told.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from slurm_fakes import calls, fake_slurm

from orchestrator.launch import slurm_query
from orchestrator.launch.slurm_query import (
    MAX_ID_LIST_CHARS,
    ClusterLimits,
    SlurmQueryError,
    id_chunks,
    job_states,
    parse_limits,
    query_states,
)

ARG_MAX_STRLEN = 128 * 1024  # Linux: the most one argument may hold


# Every asked id reported COMPLETED, as sacct -P prints it.
SACCT_ALL_COMPLETED = 'tr "," "\\n" <<< "$ids" | sed "s/$/|COMPLETED/"'


@given(st.lists(st.text("0123456789_", min_size=1, max_size=12), max_size=300),
       st.integers(min_value=12, max_value=200))
def test_chunks_keep_every_id_in_order_and_each_list_within_the_limit(ids: list[str], max_chars: int) -> None:
    chunks = id_chunks(ids, max_chars)
    assert [i for chunk in chunks for i in chunk] == ids
    assert all(chunk and len(",".join(chunk)) <= max_chars for chunk in chunks)
    # as few chunks as that allows: no two neighbours would have fitted together
    assert all(len(",".join(a + b[:1])) > max_chars for a, b in itertools.pairwise(chunks))


def test_twenty_thousand_arrays_go_in_chunks_below_the_argument_limit() -> None:
    ids = [str(10_000_000 + n) for n in range(20_000)]  # 160 KiB as one list: sacct would not start
    chunks = id_chunks(ids)
    assert len(chunks) > 1 and all(len(",".join(c)) <= MAX_ID_LIST_CHARS < ARG_MAX_STRLEN for c in chunks)


def test_a_long_id_list_is_answered_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_slurm(tmp_path, monkeypatch, sacct=SACCT_ALL_COMPLETED, squeue="exit 1")
    ids = [f"{10_000_000 + n}" for n in range(20_000)]
    states = job_states(ids)  # one list of 160 KiB: E2BIG, then silently nothing, before chunking
    assert states == dict.fromkeys(ids, "COMPLETED")
    asked = calls(log, "sacct")
    assert len(asked) > 1 and all(len(ids_list) <= MAX_ID_LIST_CHARS for ids_list in asked)
    assert calls(log, "squeue") == []


def test_a_chunk_nobody_answered_is_reported_not_dropped(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # sacct fails on the chunk holding 10000000 (the first), squeue is down: the rest is answered.
    fake_slurm(tmp_path, monkeypatch,
               sacct='if [[ "$ids" == *10000000* ]]; then\n'
                     '  echo "sacct: error: slurmdbd down" >&2; exit 1\nfi\n' + SACCT_ALL_COMPLETED,
               squeue='echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    ids = [f"{10_000_000 + n}" for n in range(10_000)]
    reply = query_states(ids)
    first = id_chunks(ids)[0]
    assert len(reply.errors) == 1
    assert "slurmdbd down" in reply.errors[0] and "Unable to contact slurm controller" in reply.errors[0]
    assert reply.answered == set(ids) - set(first)
    assert set(reply.states) == set(ids) - set(first)
    with pytest.raises(SlurmQueryError, match="slurmdbd down"):
        job_states(ids)


def test_squeue_answers_when_accounting_is_off_and_no_job_is_queued(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct='echo "Slurm accounting storage is disabled" >&2; exit 1',
               squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1')
    reply = query_states(["41", "42"])
    assert (reply.states, reply.answered, reply.errors) == ({}, {"41", "42"}, ())


SCONTROL_CONFIG = """Configuration data as of 2026-11-24T06:00:00
AccountingStorageBackupHost = (null)
MaxArraySize            = 1001
MaxDBDMsgs              = 20024
MaxJobCount             = 10000
MaxJobId                = 67043328
MinJobAge               = 300 sec
"""


def test_limits_come_from_scontrol_show_config() -> None:
    assert parse_limits(SCONTROL_CONFIG) == ClusterLimits(max_array_size=1001, max_job_count=10000)
    assert parse_limits("MaxArraySize = 0\n") == ClusterLimits(0, slurm_query.DEFAULT_MAX_JOB_COUNT)
    assert parse_limits("") == ClusterLimits(slurm_query.DEFAULT_MAX_ARRAY_SIZE,
                                             slurm_query.DEFAULT_MAX_JOB_COUNT)


def test_limits_are_asked_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = fake_slurm(tmp_path, monkeypatch, scontrol=f"cat <<'EOF'\n{SCONTROL_CONFIG}EOF")
    slurm_query.cluster_limits.cache_clear()
    try:
        assert slurm_query.cluster_limits().max_array_size == 1001
        assert slurm_query.cluster_limits().max_job_count == 10000
        assert calls(log, "scontrol") == ["config"]
    finally:
        slurm_query.cluster_limits.cache_clear()
