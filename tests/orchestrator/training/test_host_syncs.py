"""A training step that does not log reads no tensor value on the host: on a GPU, each read is a sync.

CI has no GPU, so the reads are counted where they happen: every ``.item()``, ``float()``,
``int()``, ``bool()``, ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a tensor passes through
torch's function hook (``TorchFunctionMode``) while the real trainer steps a real one-rank DDP model.
On a GPU each of them would block the host until the GPU catches up. The log step must read (once),
which shows the counter sees them. ``tests/gpu/test_train_gpu.py`` checks the same on a GPU with
``torch.cuda.set_sync_debug_mode("error")``.

SGD, because AdamW keeps its step counter as a CPU tensor and reads it on the host each step by
torch's design; that read touches no GPU (the counter never leaves the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rank_helpers import write_rows_dataset
from torch.overrides import TorchFunctionMode

from orchestrator.config import (
    CausalLmTaskConfig,
    ClassifyTaskConfig,
    DataConfig,
    GptConfig,
    LoggerConfig,
    MemoryConfig,
    MlpConfig,
    OptimConfig,
    ParallelismConfig,
    TelemetryConfig,
    TrainConfig,
    TransformerConfig,
)
from orchestrator.training import metrics, runtime, trainer
from orchestrator.training.run_log import RunLog

HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Records every torch function that hands a tensor's value to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_rows_dataset(tmp_path_factory.mktemp("data") / "train", 64, features=5, classes=3,
                              max_rows=8)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Byte tokens, one document a sample, as jobs.prepare format=text writes them."""
    import numpy as np

    from sharding import DatasetWriter

    path = tmp_path_factory.mktemp("data") / "tokens"
    rng = np.random.default_rng(0)
    with DatasetWriter(path, attributes={"tokenizer": {"kind": "bytes", "vocab_size": 257, "eos_id": 256,
                                                       "file": None}}) as writer:
        for _ in range(20):
            writer.append({"tokens": rng.integers(0, 257, int(rng.integers(5, 90))).astype(np.uint16)})
    return str(path)


# Every built-in model with the task it is built for: none may read the host per micro-batch.
MODELS = {
    "mlp": (MlpConfig(), ClassifyTaskConfig(), "rows"),
    "transformer": (TransformerConfig(), ClassifyTaskConfig(), "rows"),
    "gpt": (GptConfig(d_model=16, num_heads=2, num_layers=2), CausalLmTaskConfig(), "tokens"),
}


@pytest.mark.parametrize(("amp", "strategy", "model"),
                         [("none", "ddp", "mlp"), ("bf16", "ddp", "mlp"), ("none", "fsdp", "mlp"),
                          ("bf16", "fsdp", "mlp"), ("none", "ddp", "transformer"),
                          ("bf16", "fsdp", "transformer"), ("none", "ddp", "gpt"), ("bf16", "ddp", "gpt"),
                          ("bf16", "fsdp", "gpt")])
def test_a_step_that_does_not_log_reads_nothing_on_the_host(rank: runtime.Runtime, dataset: str,
                                                           tokens: str, tmp_path: Path, amp: str,
                                                           strategy: str, model: str) -> None:
    model_cfg, task_cfg, data = MODELS[model]
    path = dataset if data == "rows" else tokens
    cfg = TrainConfig(model=model_cfg, task=task_cfg,
                      data=DataConfig(path=path, num_classes=3, batch_size=8, seq_len=16),
                      parallelism=ParallelismConfig(strategy=strategy),
                      optim=OptimConfig(name="sgd", grad_accum_steps=2, clip_grad_norm=1.0, max_steps=10),
                      memory=MemoryConfig(amp=amp), telemetry=TelemetryConfig(enabled=False))
    run = trainer.Trainer(cfg, trainer.DataPaths(train=path, eval=None), tmp_path, rank)
    stream = run.data.batches()
    batches = iter([next(stream) for _ in range(6)])  # the loader's own work is not the step's
    window = metrics.MetricsWindow(rank, RunLog(LoggerConfig(tensorboard=False), tmp_path, 0, {}))
    with HostReads() as counted:
        for step in range(3):  # the last is a log step: its gradient norm stays on the device too
            window.add(run.optimizer_step(batches, want_norm=step == 2))
    assert counted.reads == [], f"host reads in steps that do not log: {counted.reads}"
    with HostReads() as counted:
        loss, _ = window.close(run.step, 0.1, run.grad_norm)  # a log step: the window's one read
    assert counted.reads and loss > 0
    assert run.counters.samples == 48  # 3 steps x 2 micro-batches x 8, read once, outside the steps
