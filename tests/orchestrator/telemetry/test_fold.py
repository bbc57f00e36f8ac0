"""The sampler folds its node's samples as it takes them (``telemetry.fold``): the summary it
leaves equals the fold of every raw sample, the plot's series stays bounded, a node killed before
its fold is summarised from a bounded tail with a note, and a reader with a fold opens no raw file."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeGpu, FakeNvml, busy, opened_samples, ramp, register_one_rank_per_gpu, sample

from orchestrator.sweeps.results import job_memory
from orchestrator.telemetry import fold, summary
from orchestrator.telemetry.files import register_rank, telemetry_dir
from orchestrator.telemetry.fold import Series, fold_file, read_series, series_file
from orchestrator.telemetry.plot import attempt_gaps, memory_figure
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.stats import load_records
from orchestrator.telemetry.summary import summarize, summarize_raw


def gpu_run(run_dir: Path) -> None:
    """The real sampler on two nodes (scripted NVML): GPU 0 overloaded and GPU 1 idle on n1."""
    register_one_rank_per_gpu(run_dir)
    sample(run_dir, FakeNvml([FakeGpu(used=ramp(2, 14), util=[90, 70, 95]), FakeGpu(used=[0], util=[0]),
                              busy(10, 4102), busy(9, 4103)]), num_samples=9)
    sample(run_dir, FakeNvml([busy(8, 5000), FakeGpu(used=ramp(1, 3), util=[40, 60])]), node="n2")


def cpu_run(run_dir: Path, num_samples: int = 12) -> None:
    """The real sampler in CPU mode, sampling this process as rank 0."""
    register_rank(run_dir, 0, local_rank=0, node="n1", device_index=None, environ={}, pid=os.getpid())
    sampler = MemorySampler(run_dir, "n1", nvml=None)
    ballast = []
    for i in range(num_samples):
        ballast.append(bytearray(1 << 20) if i % 3 == 0 else b"")  # RSS that moves
        sampler.sample_once()
    sampler.stop()


def same_summary(folded: dict[str, Any], raw: dict[str, Any]) -> None:
    """Peaks, counts and flags exactly; means within float tolerance (sums merged in another order)."""
    for g, h in zip(folded["gpus"], raw["gpus"], strict=True):
        assert g.pop("mean_util_pct") == pytest.approx(h.pop("mean_util_pct"))
    assert folded["sample_cost_ms"] == pytest.approx(raw["sample_cost_ms"])
    del folded["sample_cost_ms"], raw["sample_cost_ms"]
    assert folded == raw


@pytest.mark.parametrize("run", [gpu_run, cpu_run])
def test_the_samplers_fold_equals_the_fold_of_every_raw_sample(tmp_path: Path, run: Any) -> None:
    run(tmp_path)
    raw = summarize_raw(tmp_path)
    assert raw["num_samples"] >= 12 and (run is cpu_run or raw["flags"])
    with opened_samples() as opened:
        folded = summarize(tmp_path)
    assert opened == []  # the fold covers every sample: no raw file was opened
    same_summary(folded, raw)


def test_a_requeued_sampler_resumes_the_fold_of_its_node_file(tmp_path: Path) -> None:
    cpu_run(tmp_path, 5)
    cpu_run(tmp_path, 7)  # the next attempt appends to the same file
    same_summary(summarize(tmp_path), summarize_raw(tmp_path))


def test_the_series_is_bounded_keeps_peaks_and_breaks_at_a_requeue() -> None:
    records = [{"t": float(i), "node": "n1", "attempt": i // 700, "sample_s": 0.0,
                "gpus": [{"index": 0, "total_bytes": 100, "used_bytes": (i * 37) % 1000}],
                **({"ended": "TIME_LIMIT"} if i == 699 else {})} for i in range(2000)]
    series = Series(max_points=64)
    for record in records:
        series.add(record)
    points = series.records()
    assert len(points) <= 64 + 2 and series.stride >= 2000 // 64
    assert max(p["gpus"][0]["used_bytes"] for p in points) == 999
    for attempt in (0, 1, 2):  # each attempt's own peak, in points of that attempt only
        mine = [r["gpus"][0]["used_bytes"] for r in records if r["attempt"] == attempt]
        assert max(p["gpus"][0]["used_bytes"] for p in points if p["attempt"] == attempt) == max(mine)
    assert [g[0] for g in attempt_gaps(points)] == [1, 2]
    assert attempt_gaps(points)[0][3] == "TIME_LIMIT"
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)


def test_the_plot_draws_the_series_and_raw_draws_every_sample(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    gpu_run(tmp_path)
    assert series_file(telemetry_dir(tmp_path) / "n1.jsonl").exists()
    with opened_samples() as opened:
        memory_figure(tmp_path)
    assert opened == []
    points, notes = read_series(tmp_path)
    assert len(points) == len(load_records(tmp_path)) and notes == []  # fewer samples than MAX_POINTS
    with opened_samples() as opened:
        memory_figure(tmp_path, raw=True)
    assert sorted(Path(p).name for p in opened) == ["n1.jsonl", "n2.jsonl"]


def test_a_node_killed_before_its_fold_is_summarised_from_a_bounded_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_run(tmp_path)
    whole = summarize_raw(tmp_path)
    for raw in telemetry_dir(tmp_path).glob("*.jsonl"):
        fold_file(raw).unlink()
        series_file(raw).unlink()
    same_summary(summarize(tmp_path), dict(whole))  # smaller than the tail: read whole, no note
    n1 = telemetry_dir(tmp_path) / "n1.jsonl"
    line = len(n1.read_bytes().splitlines()[-1]) + 1
    monkeypatch.setattr(fold, "TAIL_BYTES", 3 * line)
    memory = summarize(tmp_path)
    assert memory["num_samples"] < whole["num_samples"]
    assert any(note.startswith("n1: no folded summary") and "switchyard plot --raw" in note
               for note in memory["notes"])
    points, notes = read_series(tmp_path)
    assert notes and len([p for p in points if p["node"] == "n1"]) <= 3


def test_a_sample_the_fold_missed_is_read_from_the_raw_files_end(tmp_path: Path) -> None:
    """The sampler killed between its raw line and its fold: that last sample (an OOM's peak,
    often) still counts; what the fold covers is not read again."""
    cpu_run(tmp_path)
    raw = telemetry_dir(tmp_path) / "n1.jsonl"
    last = json.loads(raw.read_bytes().splitlines()[-1])
    last["ranks"][0]["rss_bytes"] = 64 << 30
    with open(raw, "a") as f:
        f.write(json.dumps(last) + "\n")
    memory = job_memory(str(tmp_path))
    assert memory is not None and memory["ranks"][0]["peak_rss_bytes"] == 64 << 30
    same_summary(memory, summarize_raw(tmp_path))


def test_damaged_telemetry_is_no_summary_with_the_reason(tmp_path: Path) -> None:
    cpu_run(tmp_path)
    for raw in telemetry_dir(tmp_path).glob("*.jsonl"):
        fold_file(raw).unlink()
        with open(raw, "a") as f:  # a sample that cannot be folded: a rank without its RSS
            f.write(json.dumps({"t": 9e9, "node": "n1", "ranks": [{"rank": 0, "pid": 1}]}) + "\n")
    memory = job_memory(str(tmp_path))
    assert memory is not None and memory["mode"] == "none"
    assert memory["notes"][0].startswith("no summary: its telemetry could not be read (KeyError")


def test_a_damaged_earlier_sample_never_stops_the_sampler_recording(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A requeued sampler folds what its node file holds first: a line it cannot fold (damaged, or
    written by another version) used to fail every sample after it, so nothing more was recorded."""
    path = telemetry_dir(tmp_path) / "n1.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"t": 1.0, "node": "n1", "attempt": 0, "ranks": [{"rank": 0}]}) + "\n")
    cpu_run(tmp_path, num_samples=3)
    assert len(path.read_text().splitlines()) == 1 + 3 + 1  # its line, 3 samples, stop()'s last
    assert "cannot resume the fold of" in capsys.readouterr().out


@pytest.mark.parametrize("run", [gpu_run, cpu_run])
def test_a_one_node_run_is_summarised_from_the_memory_its_sampler_kept(
        tmp_path: Path, run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler keeps the memory section with its fold, so a killed job's summary is one file:
    10,000 of them are read in about a second, where summarising each fold with its ranks' files
    took 2.3-2.6 s. A run of two nodes (gpu_run) is still summarised from both folds."""
    run(tmp_path)
    whole = summarize_raw(tmp_path)
    nodes = len(list(telemetry_dir(tmp_path).glob("*.jsonl")))

    def not_read(*args: Any) -> Any:
        raise AssertionError("read although the sampler kept the memory section")

    if nodes == 1:
        monkeypatch.setattr(summary, "read_digest", not_read)
        monkeypatch.setattr(summary, "load_ranks", not_read)
    same_summary(job_memory(str(tmp_path)) or {}, whole)


def test_the_kept_memory_section_is_not_used_once_the_run_moved_on(tmp_path: Path) -> None:
    """A sample taken after the fold, a rank registered since (a requeue, another pid) or a rank's
    end peak: the kept section no longer says it all, and the folds and files are read instead."""
    cpu_run(tmp_path)
    raw = telemetry_dir(tmp_path) / "n1.jsonl"
    assert "kept" in json.loads(fold_file(raw).read_text())
    time.sleep(0.05)  # past the file system's timestamp granularity
    register_rank(tmp_path, 0, local_rank=0, node="n1", device_index=None, environ={}, pid=4242)
    memory = job_memory(str(tmp_path))
    assert memory is not None and memory["ranks"][0]["pid"] == 4242
    (telemetry_dir(tmp_path) / "peaks").mkdir()
    peak = {"rank": 0, "device": None, "max_rss_bytes": 5 << 30, "uss_bytes": 1 << 30}
    (telemetry_dir(tmp_path) / "peaks" / "rank-0.json").write_text(json.dumps(peak))
    memory = job_memory(str(tmp_path))
    assert memory is not None and memory["ranks"][0]["end"] == peak
    same_summary(memory, summarize_raw(tmp_path))
