"""Flags against a scripted NVML (CI has no GPU): the two seed problems (idle GPUs, GPU 0 overload)
and two more.

The fake NVML (``tests/fake_nvml.py``) is injected at the module boundary (``nvml=`` arguments).
"""

from __future__ import annotations

import json
from pathlib import Path

from fake_nvml import NO_ENV, PIDS, TOTAL, FakeGpu, FakeNvml, busy, ramp, register_one_rank_per_gpu, sample
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.telemetry.common import GIB, MIB
from orchestrator.telemetry.files import register_rank
from orchestrator.telemetry.flags import imbalance_flags
from orchestrator.telemetry.stats import GpuStats
from orchestrator.telemetry.summary import summarize


def test_one_gpu_doing_all_the_work_flags_the_three_idle_gpus(tmp_path: Path) -> None:
    """(a) Every rank forgot torch.cuda.set_device: they all run on GPU 0, GPUs 1-3 stay idle."""
    all_on_gpu0 = [[(pid, 3 * GIB) for pid in PIDS]]
    fake = FakeNvml([FakeGpu(used=ramp(2, 14), util=[0, 90, 92, 91, 90, 93], processes=all_on_gpu0)]
                    + [FakeGpu(used=[300 * MIB], util=[0]) for _ in range(3)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)

    idle = [f for f in memory["flags"] if "stayed idle" in f]
    assert [f.split(" stayed")[0] for f in idle] == [f"GPU {i} on n1 (rank {i})" for i in (1, 2, 3)]
    assert all("ranks 0, 1, 2, 3 all run on GPU 0" in f for f in idle)
    assert not any("peaked at" in f for f in memory["flags"])  # idle peers are no yardstick for GPU 0
    gpu0 = memory["gpus"][0]
    assert gpu0["peak_used_bytes"] == 14 * GIB and gpu0["mean_util_pct"] > 70


def test_all_ranks_run_on_gpu0_when_every_rank_registers_cuda0(tmp_path: Path) -> None:
    """Same mistake seen from the ranks' side: each registers cuda:0 because it never set a device."""
    fake = FakeNvml([FakeGpu(used=[12 * GIB], util=[90], processes=[[(pid, 3 * GIB) for pid in PIDS]])]
                    + [FakeGpu(used=[0], util=[0]) for _ in range(3)])
    for rank, pid in enumerate(PIDS):
        register_rank(tmp_path, rank, rank, "n1", device_index=0, environ=NO_ENV, pid=pid)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]
    assert len(flags) == 3
    assert all("(no rank) stayed idle" in f and "ranks 0, 1, 2, 3 all run on GPU 0" in f for f in flags)


def test_gpu0_holding_extra_memory_is_flagged(tmp_path: Path) -> None:
    """(b) Every rank loads a checkpoint onto cuda:0: GPU 0 holds +6 GiB over its busy peers."""
    fake = FakeNvml([FakeGpu(used=ramp(8, 16), util=[90],
                             processes=[[(PIDS[0], 9 * GIB)] + [(pid, 2 * GIB) for pid in PIDS[1:]]])]
                    + [busy(10, pid) for pid in PIDS[1:]])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]

    [imbalance] = [f for f in flags if "peaked at" in f]
    assert imbalance.startswith("GPU 0 on n1 peaked at 16.0 GiB, 1.6x the median of its peers (10.0 GiB)")
    assert "ranks 1, 2, 3 also hold memory here" in imbalance and "map_location='cpu'" in imbalance
    assert not any("stayed idle" in f for f in flags)


def test_extra_memory_is_flagged_without_process_lists(tmp_path: Path) -> None:
    """NVML may refuse process lists (containers): the imbalance still shows in the per-GPU numbers."""
    gpus = [FakeGpu(used=[16 * GIB], util=[90])] + [FakeGpu(used=[10 * GIB], util=[90]) for _ in range(3)]
    fake = FakeNvml(gpus, deny_processes=True)
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)
    assert [f[:24] for f in memory["flags"]] == ["GPU 0 on n1 peaked at 16"]
    assert all(g["processes"] == [] for g in memory["gpus"])


def test_rank_holding_memory_on_another_gpu_is_flagged(tmp_path: Path) -> None:
    """(c) Rank 2's process is listed on GPU 0 as well as on its own GPU 2."""
    gpus = [busy(10, pid) for pid in PIDS]
    gpus[0].processes = [[(PIDS[0], int(9.5 * GIB)), (PIDS[2], int(1.1 * GIB))]]
    fake = FakeNvml(gpus)
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    flags = summarize(tmp_path)["flags"]
    assert flags == [f"rank 2 (pid {PIDS[2]}) holds 1.1 GiB on GPU 0 on n1, its own device is GPU 2: "
                     f"call torch.cuda.set_device(local_rank) first and load with map_location='cpu'"]


def test_balanced_healthy_run_has_no_flags(tmp_path: Path) -> None:
    """(d) Four busy GPUs within 10 % of each other, each rank on its own."""
    fake = FakeNvml([FakeGpu(used=ramp(9 + i * 0.3, 10 + i * 0.3), util=[88 + i],
                             processes=[[(pid, 9 * GIB)]]) for i, pid in enumerate(PIDS)])
    register_one_rank_per_gpu(tmp_path)
    sample(tmp_path, fake)
    memory = summarize(tmp_path)
    assert memory["flags"] == [] and memory["notes"] == []
    assert memory["mode"] == "gpu" and memory["num_samples"] == 7  # 6 + the final one at stop()
    assert [g["ranks"] for g in memory["gpus"]] == [[0], [1], [2], [3]]
    assert [g["processes"] for g in memory["gpus"]][3] == [{"rank": 3, "peak_used_bytes": 9 * GIB}]


def test_gpu0_on_every_node_is_flagged_against_peers_across_nodes(tmp_path: Path) -> None:
    for node, pids in (("n1", PIDS), ("n2", [p + 100 for p in PIDS])):
        gpus = [busy(16, pids[0])] + [busy(10, pid) for pid in pids[1:]]
        for rank, pid in enumerate(pids):
            register_rank(tmp_path, rank + (4 if node == "n2" else 0), rank, node, rank, NO_ENV, pid=pid)
        sample(tmp_path, FakeNvml(gpus), node=node)
    flags = summarize(tmp_path)["flags"]
    assert [f.split(" peaked")[0] for f in flags] == ["GPU 0 on n1", "GPU 0 on n2"]


def test_short_run_is_not_called_idle(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(used=[1 * GIB], util=[90]), FakeGpu(used=[0], util=[0])])
    sample(tmp_path, fake, num_samples=1)  # 2 samples: the job ended during start-up
    assert summarize(tmp_path)["flags"] == []


def test_torch_peaks_flag_other_devices_when_nvml_pids_do_not_match(tmp_path: Path) -> None:
    """In a container NVML lists host pids; the allocator's own per-device counters still tell."""
    fake = FakeNvml([busy(10, 90000 + i) for i in range(2)])
    register_one_rank_per_gpu(tmp_path, pids=PIDS[:2])
    sample(tmp_path, fake)
    peak = {"rank": 1, "device": 1, "max_allocated_bytes": 8 * GIB, "max_reserved_bytes": 9 * GIB,
            "other_devices": [{"device": 0, "max_reserved_bytes": 2 * GIB}]}
    (tmp_path / "telemetry" / "peaks").mkdir()
    (tmp_path / "telemetry" / "peaks" / "rank-1.json").write_text(json.dumps(peak))
    memory = summarize(tmp_path)
    assert memory["flags"] == [
        "rank 1 reserved 2.0 GiB on cuda:0 through torch, its own device is cuda:1: "
        "call torch.cuda.set_device(local_rank) first and load with map_location='cpu'"]
    assert "PID namespace" in memory["notes"][0]
    assert memory["ranks"][1]["end"]["max_allocated_bytes"] == 8 * GIB


@settings(max_examples=60, deadline=None)
@given(peaks_gib=st.lists(st.floats(2.0, 2.4), min_size=2, max_size=8), extra=st.data())
def test_imbalance_flags_exactly_the_gpu_with_extra_memory(peaks_gib: list[float],
                                                           extra: st.DataObject) -> None:
    def stats(peaks: list[float]) -> list[GpuStats]:
        return [GpuStats("n1", i, total_bytes=TOTAL, peak_used_bytes=int(p * GIB), num_samples=5,
                         util_sum=90.0, util_count=1) for i, p in enumerate(peaks)]

    assert imbalance_flags(stats(peaks_gib)) == []  # within 20 % of each other: DDP replicas agree
    heavy = extra.draw(st.integers(0, len(peaks_gib) - 1))
    bumped = [p + 6.0 if i == heavy else p for i, p in enumerate(peaks_gib)]
    [flag] = imbalance_flags(stats(bumped))
    assert flag.startswith(f"GPU {heavy} on n1 peaked at")
