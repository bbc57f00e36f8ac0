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
from orchestrator.telemetry.plot import plot_run
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
