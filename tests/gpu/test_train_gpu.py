"""The training job on a real GPU: no host sync on a step that does not log, and every mode runs.

Skipped where no NVIDIA GPU is visible; ``make gpu-check`` runs it on a GPU node.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from rank_helpers import one_rank, write_rows_dataset
from train_helpers import run_train

from orchestrator.config import DataConfig, LoggerConfig, MlpConfig, OptimConfig, TelemetryConfig, TrainConfig
from orchestrator.training import metrics, preemption, runtime, trainer
from orchestrator.training.run_log import RunLog

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and driver"),
]


@pytest.fixture(scope="module")
def one_gpu_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runtime.Runtime]:
    """A one-rank group as the runtime makes it on a GPU: cpu:gloo,cuda:nccl, bound to cuda:0."""
    with one_rank(tmp_path_factory.mktemp("pg"), torch.device("cuda", 0)) as rt:
        yield rt


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_rows_dataset(tmp_path_factory.mktemp("data") / "train", 256, features=16, classes=4,
                              max_rows=32)


@pytest.mark.parametrize(("amp", "strategy"), [("none", "ddp"), ("bf16", "ddp"), ("none", "fsdp"),
                                               ("bf16", "fsdp")])
def test_steps_that_do_not_log_never_sync_the_gpu(one_gpu_rank: runtime.Runtime, dataset: str,
                                                 tmp_path: Path, amp: str, strategy: str) -> None:
    from orchestrator.config import MemoryConfig, ParallelismConfig

    cfg = TrainConfig(model=MlpConfig(), data=DataConfig(path=dataset, num_classes=4, batch_size=32),
                      parallelism=ParallelismConfig(gpus_per_node=1, strategy=strategy),
                      optim=OptimConfig(grad_accum_steps=2, clip_grad_norm=1.0, max_steps=50),
                      memory=MemoryConfig(amp=amp), telemetry=TelemetryConfig(enabled=False))
    run = trainer.Trainer(cfg, trainer.DataPaths(train=dataset, eval=None), tmp_path, one_gpu_rank)
    stream = run.data.batches()
    window = metrics.MetricsWindow(one_gpu_rank, RunLog(LoggerConfig(tensorboard=False), tmp_path, 0, {}))
    stops = preemption.StopPoll(run.stop)
    window.add(run.optimizer_step(stream))  # the first step (optimizer state, cuBLAS handles)
    torch.cuda.synchronize()
    batches = iter([next(stream) for _ in range(10)])  # 5 steps of 2 micro-batches
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        for _ in range(4):
            window.add(run.optimizer_step(batches))
            stops.poll()  # the stop flag: a CPU tensor over gloo, no GPU sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.set_sync_debug_mode("error")
    try:  # a log step's gradient norm stays on the device until the window closes
        window.add(run.optimizer_step(batches, want_norm=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stops.drain()
    loss, _ = window.close(run.step, 0.1, run.grad_norm)
    assert loss > 0


def test_batches_copied_on_the_side_stream_arrive_intact(dataset: str) -> None:
    from orchestrator.training.device_batches import to_device
    from sharding import ShardedSampler, make_loader, open_dataset

    ds = open_dataset(dataset)

    def loader(pin: bool) -> object:
        return make_loader(ds, ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=0), 16,
                           pin_memory=pin)

    fields = ("x", "x_mask", "y", "is_pad")
    expected = [dict(b) for b in loader(False)]  # type: ignore[attr-defined]
    got = list(to_device(loader(True), torch.device("cuda", 0), fields))  # type: ignore[arg-type]
    assert len(got) == len(expected)
    for batch, want in zip(got, expected, strict=True):
        assert all(batch[k].is_cuda for k in fields) and not batch["index"].is_cuda
        for k in fields:
            # computed on the compute stream, as a step would: it waits for this batch's copy
            assert torch.equal(batch[k].cpu(), want[k]), k


def test_the_copy_stream_is_the_loaders_alone() -> None:
    """No draw from torch's stream pools (where NCCL's process group and FSDP2 take theirs) returns
    the prefetch's copy stream, and every epoch's loader gets the same one."""
    import warnings

    from orchestrator.training.device_batches import copy_stream

    device = torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the pool fails here
        mine = copy_stream(device)
    assert copy_stream(device) is mine
    pools = {torch.cuda.Stream(device, priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    assert mine.cuda_stream not in pools | {torch.cuda.current_stream(device).cuda_stream}
    side = torch.ones(1 << 20, device=device)
    with torch.cuda.stream(mine):  # it runs work in torch's context like any stream
        doubled = side * 2
    torch.cuda.synchronize()
    assert float(doubled.sum()) == 2 * (1 << 20)


def train(tmp_path: Path, *overrides: str) -> dict[str, object]:
    run_dir = tmp_path / "run"
    proc = run_train("parallelism=gpu", "optim.max_steps=30", *overrides, "data.demo_num_samples=1024",
                     cache_dir=tmp_path / "cache", run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads((run_dir / "summary.json").read_text()))


@pytest.mark.parametrize("mode", ["debug", "local"])
def test_the_job_trains_on_the_gpu(tmp_path: Path, mode: str) -> None:
    summary = train(tmp_path, f"cluster={mode}", "parallelism.gpus_per_node=1")
    assert summary["backend"] == "nccl" and summary["world_size"] == 1
    memory = summary["memory"]
    assert isinstance(memory, dict) and memory["mode"] == "gpu"
    assert memory["ranks"][0]["end"]["max_allocated_bytes"] > 0


def test_fsdp_trains_checkpoints_and_resumes_on_the_gpu(tmp_path: Path) -> None:
    gpus = min(torch.cuda.device_count(), 2)
    same = ["cluster=local", f"parallelism.gpus_per_node={gpus}", "parallelism.strategy=fsdp",
            "memory.amp=bf16", "model=transformer"]
    summary = train(tmp_path, *same)
    assert summary["backend"] == "nccl" and len(set(summary["param_checksum_per_rank"])) == 1  # type: ignore[arg-type]
    assert len(list((tmp_path / "run" / "checkpoints").glob("step-*.dcp/*.distcp"))) == gpus
    resumed = train(tmp_path, *same, "optim.max_steps=40")
    assert resumed["resumed_from"] == {"path": str(tmp_path / "run" / "checkpoints" / "step-000000030.dcp"),
                                       "step": 30}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_local_ranks_take_one_gpu_each(tmp_path: Path) -> None:
    summary = train(tmp_path, "cluster=local", "parallelism.gpus_per_node=2")
    assert summary["world_size"] == 2
    assert len(set(summary["param_checksum_per_rank"])) == 1  # type: ignore[arg-type]
    memory = summary["memory"]
    assert isinstance(memory, dict) and sorted(r["device"] for r in memory["ranks"]) == [0, 1]


def test_peak_memory_is_per_window_on_the_gpu(tmp_path: Path) -> None:
    from orchestrator.telemetry.files import record_rank_peak

    device = torch.device("cuda", 0)
    peaks = metrics.WindowPeaks(device)
    peaks.close_window()
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    del big
    busy, quiet = peaks.close_window(), peaks.close_window()
    assert busy >= 2**30 > quiet
    assert record_rank_peak(tmp_path, 0, 0, floor=peaks.run_peaks())["max_allocated_bytes"] >= 2**30
