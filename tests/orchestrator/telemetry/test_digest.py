"""A run's telemetry folded in pieces gives the summary of all of it: what lets `switchyard status`
read only the samples a running job took since the last call (tests/fake_nvml.py drives the real
sampler; the CPU samples are the sampler's own format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_nvml import FakeGpu, FakeNvml, busy, ramp, register_one_rank_per_gpu, sample
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.telemetry.files import telemetry_dir
from orchestrator.telemetry.stats import Digest
from orchestrator.telemetry.summary import summarize, summary_of


def gpu_run(run_dir: Path) -> None:
    """Two nodes: an overloaded GPU 0 and an idle GPU on n1, busy GPUs with processes on n2."""
    register_one_rank_per_gpu(run_dir)
    sample(run_dir, FakeNvml([FakeGpu(used=ramp(2, 14), util=[90, 70, 95]), FakeGpu(used=[0], util=[0]),
                              busy(10, 4102), busy(9, 4103)]), num_samples=9)
    sample(run_dir, FakeNvml([busy(8, 5000), FakeGpu(used=ramp(1, 3), util=[40, 60])]), node="n2")


def cpu_run(run_dir: Path) -> None:
    lines = [json.dumps({"t": 100.0 + 5 * i, "node": node, "sample_s": 0.0001 * (1 + i % 3),
                         "ranks": [{"rank": r, "pid": 10 + r, "rss_bytes": 2**30 + 2**20 * ((i * 7 + r) % 5),
                                    "shared_bytes": 0, "uss_bytes": 2**29 + i if i % 3 == 0 else None}
                                   for r in ranks]})
             for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))) for i in range(20)]
    tel = telemetry_dir(run_dir)
    tel.mkdir(parents=True)
    for node in ("n1", "n2"):
        (tel / f"{node}.jsonl").write_text("".join(line + "\n" for line in lines if f'"{node}"' in line))


def fold_in_pieces(run_dir: Path, cuts: list[float]) -> Digest:
    """Each node file grown in pieces cut at these fractions (mid-line too), the digest brought
    up to date after each piece and passed through JSON, as the registry keeps it."""
    files = {p: p.read_bytes() for p in telemetry_dir(run_dir).glob("*.jsonl")}
    for path in files:
        path.write_bytes(b"")
    state = Digest().to_json()
    for cut in [*sorted(cuts), 1.0]:
        for path, data in files.items():
            path.write_bytes(data[:int(len(data) * cut)])
        digest = Digest.from_json(json.loads(json.dumps(state)))
        digest.read_new(run_dir)
        state = digest.to_json()
    return Digest.from_json(state)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), max_size=6), st.sampled_from(["gpu", "cpu"]))
def test_a_digest_folded_in_pieces_summarises_like_all_the_samples_at_once(
        tmp_path_factory: pytest.TempPathFactory, cuts: list[float], mode: str) -> None:
    run_dir = tmp_path_factory.mktemp(mode)
    (gpu_run if mode == "gpu" else cpu_run)(run_dir)
    whole = summarize(run_dir)
    assert whole["mode"] == mode and whole["num_samples"] > 15
    assert mode == "cpu" or whole["flags"]  # the GPU run's problems are flagged
    assert summary_of(run_dir, fold_in_pieces(run_dir, cuts)) == whole


def test_a_replaced_file_is_folded_again_from_its_start(tmp_path: Path) -> None:
    cpu_run(tmp_path)
    digest = Digest()
    digest.read_new(tmp_path)
    node_file = telemetry_dir(tmp_path) / "n1.jsonl"
    node_file.write_text(node_file.read_text().splitlines(keepends=True)[0])  # a new run's first line
    digest.read_new(tmp_path)
    assert summary_of(tmp_path, digest) == summarize(tmp_path)
