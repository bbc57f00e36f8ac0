"""The CPU fallback for real, with child processes that hold memory (no NVML, no mock)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_nvml import png_size

from orchestrator.telemetry.common import GIB, MIB
from orchestrator.telemetry.files import record_rank_peak, register_rank
from orchestrator.telemetry.plot import plot_run
from orchestrator.telemetry.sampler import CPU_MODE_INFO, MemorySampler
from orchestrator.telemetry.summary import format_summary, summarize

CHILD = """
import sys, time, pathlib
from orchestrator.telemetry.files import register_rank
run_dir, rank, mib = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
held = b"x" * (mib << 20)  # written, so resident and private
register_rank(run_dir, rank, local_rank=rank, node="cpu-node", device_index=None)
(run_dir / f"ready-{rank}").touch()
time.sleep(60)
"""


@pytest.fixture
def two_ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two real processes holding 40 and 120 MiB, registered as ranks 0 and 1 of node cpu-node."""
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(rank), str(mib)])
                for rank, mib in ((0, 40), (1, 120))]
    try:
        deadline = time.monotonic() + 20
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, "child ranks did not start within 20 s"
            assert all(c.poll() is None for c in children), "a child rank exited early"
            time.sleep(0.05)
        yield children
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_cpu_fallback_records_rss_and_uss_of_real_ranks(
        tmp_path: Path, two_ranks: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]) -> None:
    with MemorySampler(tmp_path, "cpu-node", interval_s=0.1, nvml=None) as sampler:
        time.sleep(1.0)
    assert not sampler.is_gpu
    assert capsys.readouterr().out.count(CPU_MODE_INFO) == 1

    lines = (tmp_path / "telemetry" / "cpu-node.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) >= 5
    pids = [(0, two_ranks[0].pid), (1, two_ranks[1].pid)]
    assert all([(r["rank"], r["pid"]) for r in record["ranks"]] == pids for record in records)
    for rank, mib in ((0, 40), (1, 120)):
        readings = [r for record in records for r in record["ranks"] if r["rank"] == rank]
        assert all(r["rss_bytes"] >= mib * MIB and r["shared_bytes"] > 0 for r in readings)
        uss = [r["uss_bytes"] for r in readings if r["uss_bytes"] is not None]
        assert uss and all(mib * MIB <= u <= max(r["rss_bytes"] for r in readings) for u in uss)

    memory = summarize(tmp_path)
    assert memory["mode"] == "cpu" and memory["flags"] == []
    assert memory["ranks"][1]["peak_uss_bytes"] >= 120 * MIB
    [node] = memory["nodes"]
    assert node["peak_total_uss_bytes"] >= 160 * MIB
    assert node["peak_total_rss_bytes"] >= node["peak_total_uss_bytes"]
    assert "cpu-node rank 1: peak RSS" in format_summary(memory)
    png = plot_run(tmp_path)
    assert png == tmp_path / "telemetry" / "memory.png"
    width, height = png_size(png)
    assert width == 1000 and height > 300 and png.stat().st_size > 10_000


def test_uss_reads_are_rationed_but_rss_is_read_every_sample(
        tmp_path: Path, two_ranks: list[subprocess.Popen[bytes]]) -> None:
    sampler = MemorySampler(tmp_path, "cpu-node", nvml=None)
    first, second = sampler.sample_once()["ranks"], sampler.sample_once()["ranks"]
    sampler.stop()
    assert all(r["uss_bytes"] is not None for r in first)
    # a USS read is due again only after 100x its own cost (>= 10 ms here): not microseconds later
    assert all(r["uss_bytes"] is None and r["rss_bytes"] > 0 for r in second)


def test_cpu_sampler_skips_ranks_that_exited(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    register_rank(tmp_path, 0, 0, "n1", None, pid=child.pid)
    register_rank(tmp_path, 1, 1, "n1", None)  # this process
    sampler = MemorySampler(tmp_path, "n1", nvml=None)
    record = sampler.sample_once()
    sampler.stop()
    assert [r["rank"] for r in record["ranks"]] == [1]


def test_record_rank_peak_on_cpu(tmp_path: Path) -> None:
    peak = record_rank_peak(tmp_path, rank=3, device_index=None)
    on_disk = json.loads((tmp_path / "telemetry" / "peaks" / "rank-3.json").read_text())
    assert on_disk == peak and peak["device"] is None
    assert peak["max_rss_bytes"] >= peak["uss_bytes"] > 10 * MIB
    assert summarize(tmp_path)["ranks"] == [{"rank": 3, "node": None, "local_rank": None, "pid": None,
                                             "device": None, "peak_rss_bytes": None, "peak_uss_bytes": None,
                                             "end": peak}]


def test_cpu_rank_with_far_more_private_memory_is_flagged(tmp_path: Path) -> None:
    uss = {0: 6 * GIB, 1: 2 * GIB, 2: int(2.1 * GIB), 3: int(1.9 * GIB)}
    lines = [{"t": t, "node": "n1", "sample_s": 0.001,
              "ranks": [{"rank": r, "pid": 10 + r, "rss_bytes": u + GIB, "shared_bytes": GIB,
                         "uss_bytes": u if t == 1.0 else None}  # USS is not read every sample
                        for r, u in uss.items()]}
             for t in (1.0, 2.0)]
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "n1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    memory = summarize(tmp_path)
    assert memory["flags"] == [
        "rank 0 on n1 peaked at 6.0 GiB of private memory (USS), 3.0x the median of its peers (2.0 GiB): "
        "it keeps something the others do not (evaluation data, a second copy of the dataset?)"]
    assert memory["nodes"] == [{"node": "n1", "peak_total_rss_bytes": sum(uss.values()) + 4 * GIB,
                                "peak_total_uss_bytes": sum(uss.values())}]
