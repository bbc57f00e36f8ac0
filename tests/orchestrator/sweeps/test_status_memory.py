"""`switchyard status` and `show` surface each run's memory section and its warnings."""

from __future__ import annotations

import io
import json
from pathlib import Path

from orchestrator.registry.db import Job, Registry
from orchestrator.sweeps.status import cmd_show, cmd_status

GIB = 2**30
# The shape telemetry.summarize writes into summary.json, for the "GPU 0 holds extra memory" case.
GPU0_OVERLOADED = {
    "mode": "gpu", "num_samples": 12, "duration_s": 60.0, "sample_cost_ms": {"mean": 0.1, "max": 0.3},
    "gpus": [{"node": "n1", "index": i, "total_bytes": 80 * GIB, "mean_util_pct": 90.0, "ranks": [i],
              "peak_used_bytes": (16 if i == 0 else 10) * GIB, "processes": []} for i in range(4)],
    "ranks": [], "nodes": [], "notes": [],
    "flags": ["GPU 0 on n1 peaked at 16.0 GiB, 1.6x the median of its peers (10.0 GiB): load "
              "checkpoints with map_location='cpu'"],
}


def make_registry(tmp_path: Path) -> Registry:
    reg = Registry(tmp_path / "r.db")
    sweep_id = reg.create_sweep("train", "optim.lr=0.1,0.2", str(tmp_path), "local", "entry")
    reg.add_jobs(Job(sweep_id, n, [f"optim.lr=0.{n + 1}"], str(tmp_path / str(n)), {}, 20) for n in range(2))
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"memory": GPU0_OVERLOADED}))
    return reg


def test_status_shows_peak_memory_and_the_warning(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cmd_status(make_registry(tmp_path), "1", as_json=False, out=out) == 0
    text = out.getvalue()
    assert "PEAK MEM" in text
    assert "16.00 GiB !1" in text  # the job's highest GPU peak, and how many flags it raised
    assert "memory warnings:\n  1/0: ! GPU 0 on n1 peaked at 16.0 GiB" in text


def test_show_prints_the_memory_section_per_gpu(tmp_path: Path) -> None:
    out = io.StringIO()
    assert cmd_show(make_registry(tmp_path), "1/0", as_json=False, out=out) == 0
    text = out.getvalue()
    assert "n1 GPU 0: peak  16.0 / 80.0 GiB, mean util   90%" in text
    assert "! GPU 0 on n1 peaked at 16.0 GiB" in text


def test_json_carries_the_memory_section(tmp_path: Path) -> None:
    out = io.StringIO()
    cmd_status(make_registry(tmp_path), "1", as_json=True, out=out)
    jobs = json.loads(out.getvalue())["jobs"]
    assert jobs[0]["memory"]["flags"] == GPU0_OVERLOADED["flags"] and jobs[1]["memory"] is None
