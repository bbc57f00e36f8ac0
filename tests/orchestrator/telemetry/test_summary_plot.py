"""The summary text for ``switchyard status`` and the plot.

The fake NVML (``tests/fake_nvml.py``) is injected at the module boundary (``nvml=`` arguments).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from fake_nvml import NO_ENV, FakeGpu, FakeNvml, busy, png_size, ramp, register_one_rank_per_gpu, sample

from orchestrator.telemetry.common import TelemetryError
from orchestrator.telemetry.files import register_rank
from orchestrator.telemetry.plot import attempt_gaps, memory_figure, plot_run
from orchestrator.telemetry.sampler import MemorySampler
from orchestrator.telemetry.summary import format_summary, summarize


def test_summary_is_json_and_status_text_shows_peaks_util_and_flags(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(used=ramp(2, 14), util=[90])] + [FakeGpu(used=[0], util=[0]) for _ in range(3)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = json.loads(json.dumps(summarize(tmp_path)))
    text = format_summary(memory)
    assert "n1 GPU 0: peak  14.0 / 80.0 GiB, mean util   90%, rank 0" in text
    assert text.count("  ! ") == 3


def test_plot_draws_one_subplot_per_node_with_flags(tmp_path: Path) -> None:
    for node in ("n1", "n2"):
        sample(tmp_path, FakeNvml([FakeGpu(used=ramp(2, 14), util=[90]), FakeGpu(used=[0], util=[0])]),
               node=node)
    out = plot_run(tmp_path, tmp_path / "plots" / "mem.png")
    width, height = png_size(out)
    assert width == 1000 and height > 700  # two nodes stacked, and a line per flag under them
    assert out.stat().st_size > 20_000  # lines, legends and text, not an empty canvas


def test_plot_of_an_empty_run_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match=r"no telemetry samples in .*telemetry: was the memory sampler"):
        plot_run(tmp_path)
    assert summarize(tmp_path)["mode"] == "none"


def test_sampling_cost_is_recorded_and_small(tmp_path: Path) -> None:
    """Overhead of the sampler's own work (rank table, records, JSON, write) for 8 GPUs and 8 ranks."""
    fake = FakeNvml([busy(10, 100 + i) for i in range(8)])
    for rank in range(8):
        register_rank(tmp_path, rank, rank, "n1", rank, NO_ENV, pid=100 + rank)
    sampler = MemorySampler(tmp_path, "n1", nvml=fake, environ=NO_ENV)
    costs = [sampler.sample_once()["sample_s"] for _ in range(50)]
    sampler.stop()
    assert statistics.median(costs) < 0.005
    assert summarize(tmp_path)["sample_cost_ms"]["mean"] is not None


def write_two_attempts(run_dir: Path) -> None:
    """A rank's samples over two attempts: the first stopped at its time limit and was requeued,
    the second started 150 s later (issue 27: the plot joined the two across the gap)."""
    lines = []
    for attempt, start in ((0, 1000.0), (1, 1160.0)):
        for i in range(5):
            record = {"t": start + i * 2.0, "node": "n1", "attempt": attempt, "sample_s": 0.001,
                      "ranks": [{"rank": 0, "pid": 10 + attempt, "rss_bytes": (4 - attempt * 3 + i) * 2**30,
                                 "shared_bytes": 0, "uss_bytes": None}]}
            if attempt == 0 and i == 4:
                record["ended"] = "TIME_LIMIT"
            lines.append(json.dumps(record))
    (run_dir / "telemetry").mkdir(parents=True)
    (run_dir / "telemetry" / "n1.jsonl").write_text("\n".join(lines) + "\n")


def test_the_plot_breaks_its_lines_at_a_requeue_and_marks_the_gap(tmp_path: Path) -> None:
    write_two_attempts(tmp_path)
    (ax,) = memory_figure(tmp_path).axes
    segments = [line.get_xdata() for line in ax.get_lines()]
    assert [(min(xs), max(xs)) for xs in segments] == [(0, 8), (160, 168)], "one line per attempt"
    assert [line.get_label() for line in ax.get_lines()] == ["rank 0 RSS", "_rank 0 RSS"]
    assert len({line.get_color() for line in ax.get_lines()}) == 1, "one rank, one colour"
    (note,) = [t.get_text() for t in ax.texts]
    assert note == "attempt 1: previous ended (TIME_LIMIT),\n152 s idle"
    (legend,) = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == "rank 0 RSS"


def test_an_attempt_killed_before_its_last_sample_is_named_so(tmp_path: Path) -> None:
    write_two_attempts(tmp_path)
    path = tmp_path / "telemetry" / "n1.jsonl"
    path.write_text(path.read_text().replace(', "ended": "TIME_LIMIT"', ""))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert attempt_gaps(records) == [(1, 1008.0, 1160.0, "without a last sample")]


def test_the_sampler_marks_its_attempt_and_why_it_ended(tmp_path: Path) -> None:
    class Stopped(SystemExit):
        stop_reason = "PREEMPTED"

    register_rank(tmp_path, 0, 0, "n1", None, NO_ENV)
    with pytest.raises(Stopped), MemorySampler(tmp_path, "n1", 60, nvml=None, environ=NO_ENV, attempt=2):
        raise Stopped(-1)
    records = [json.loads(line) for line in (tmp_path / "telemetry" / "n1.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in records} == {2}
    assert [r.get("ended") for r in records][-1] == "PREEMPTED"
