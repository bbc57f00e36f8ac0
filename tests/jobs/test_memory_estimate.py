"""The memory estimate at submission: a step too large for the GPU is refused before anything is
queued, naming an option whose own estimate fits; every submission prints one line; summary.json
keeps the estimate beside the measured peak. On the SLURM cluster:
tests/slurm/test_memory_estimate_on_slurm.py."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import cast

import pytest
from fake_nvml import FakeGpu, FakeNvml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from train_helpers import run_train

from jobs import train
from orchestrator.config import ConfigError, TrainConfig
from orchestrator.telemetry import nvml
from orchestrator.training import checks, estimate
from orchestrator.training.estimate import FIT_FRACTION, GIB
from orchestrator.training.tasks import build_task
from sharding import open_dataset

SMALL = ["model=transformer", "data.demo_num_samples=256", "data.batch_size=32"]
ON_A_GPU = ["parallelism.gpus_per_node=1"]  # cluster=local: the size comes from cluster.gpu_mem_gb


def config(cache: Path, *overrides: str) -> TrainConfig:
    with initialize_config_module("conf", version_base="1.3"):
        composed = compose("train", overrides=[*SMALL, f"data.cache_dir={cache}", *overrides])
    return cast(TrainConfig, OmegaConf.to_object(composed))


def memory_check(cfg: TrainConfig) -> estimate.MemoryReport | None:
    """What check_before_submit runs; called alone where its later GPU-count check would refuse
    ``parallelism.gpus_per_node=1`` on this machine."""
    ds = open_dataset(train.data_paths(cfg, generate=True).train)
    task = build_task(cfg.task, cfg.data)
    task.setup(ds)
    return estimate.check_memory(cfg, task, ds, checks.example_batch(task, ds))


def peak_of(cfg: TrainConfig) -> int:
    found = memory_check(dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, estimate="warn")))
    assert found is not None and found.estimate is not None
    return found.estimate.peak


def suggested(error: str) -> list[str]:
    found = re.search(r"\(try (.+), or memory\.estimate=warn to submit anyway\)", error)
    assert found, error
    return found.group(1).split()


def test_a_step_too_large_for_the_gpu_is_refused_naming_an_option_that_fits(tmp_path: Path) -> None:
    peak = peak_of(config(tmp_path, *ON_A_GPU))
    gpu_gib = peak * 0.9 / GIB  # the step needs 111% of it
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, *ON_A_GPU, f"cluster.gpu_mem_gb={gpu_gib}"))
    message = str(refused.value)
    assert message.startswith(f"memory: the estimated peak is {estimate.gib(peak)} per rank, above 95% of "
                              f"the {estimate.gib(gpu_gib * GIB)} of cluster.gpu_mem_gb=")
    assert "nothing was queued; the cheapest option that fits: memory.amp=bf16" in message
    option = config(tmp_path, *ON_A_GPU, f"cluster.gpu_mem_gb={gpu_gib}", *suggested(message))
    assert peak_of(option) <= FIT_FRACTION * gpu_gib * GIB  # the named option's own estimate fits


def test_when_no_single_option_fits_the_options_are_added_up(tmp_path: Path) -> None:
    peak = peak_of(config(tmp_path, *ON_A_GPU))
    gpu_gib = peak * 0.2 / GIB  # bf16, checkpointing, accumulation to an eighth: none fits alone
    with pytest.raises(ConfigError) as refused:
        train.check_before_submit(config(tmp_path, *ON_A_GPU, f"cluster.gpu_mem_gb={gpu_gib}"))
    overrides = suggested(str(refused.value))
    assert len(overrides) > 1 and overrides[0] == "memory.amp=bf16", overrides
    assert peak_of(config(tmp_path, *ON_A_GPU, *overrides)) <= FIT_FRACTION * gpu_gib * GIB


def test_warn_and_off_let_the_submission_go_on(tmp_path: Path) -> None:
    tiny = "cluster.gpu_mem_gb=0.0001"
    report = memory_check(config(tmp_path, *ON_A_GPU, tiny, "memory.estimate=warn"))
    assert report is not None and report.fraction is not None and report.fraction > 1
    assert memory_check(config(tmp_path, *ON_A_GPU, tiny, "memory.estimate=off")) is None


def test_a_run_prints_the_line_and_its_summary_keeps_the_estimate_beside_the_peak(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train(*SMALL, "optim.max_steps=2", "telemetry.enabled=false",
                     f"memory.estimate_cache={tmp_path / 'memo'}",  # run here, not remembered
                     cache_dir=tmp_path / "cache", run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^memory: [\d.]+ MiB peak per rank of [\d.]+ GiB host memory per rank \(estimate\)$",
                     proc.stdout, re.MULTILINE), proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    found = summary["memory_estimate"]
    assert found["estimate_bytes"]["peak"] > 0 and found["capacity_name"] == "host memory per rank"
    assert len(summary["peak_mem_bytes_per_rank"]) == 2  # the measured peak, beside it


HOST_READING_MODEL = '''
from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """Reads a value on the host each step: no fake (or meta) tensor can answer that."""

    def forward(self, x, mask):
        out = super().forward(x, mask)
        return out * 0 if float(out.detach().abs().max()) > 1e9 else out
'''


def test_a_model_that_reads_values_on_the_host_is_submitted_unestimated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "host_reading.py").write_text(HOST_READING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    report = memory_check(config(tmp_path, "model=custom", "model._target_=host_reading.Net"))
    assert report is not None and report.estimate is None
    assert report.line().startswith("memory: not estimated (the step does not run on fake tensors: ")


BF16 = ["parallelism=gpu", "memory.amp=bf16"]


@pytest.mark.parametrize("gres, named", [("--gres=gpu:v100:4", r"V100 \(16 or 32 GiB"),
                                         ("--gres=gpu:t4:2", "T4")])
def test_bf16_on_a_slurm_gpu_type_without_it_is_refused_before_submission(tmp_path: Path, gres: str,
                                                                           named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^memory.amp=bf16 is invalid on {named}.*: it has no bf16 "
                                          r"\(compute capability below 8.0\) \(try memory.amp=fp16, "
                                          r"which trains with a gradient scaler, or memory.amp=none"):
        train.check_before_submit(config(tmp_path, "cluster=slurm", *BF16,
                                         f"cluster.sbatch_args=[\"{gres}\"]"))
    estimate.check_bf16(config(tmp_path, "cluster=slurm", *BF16, 'cluster.sbatch_args=["--gres=gpu:h100:4"]'))
    estimate.check_bf16(config(tmp_path, "cluster=slurm", "parallelism=gpu", "memory.amp=fp16",
                               f"cluster.sbatch_args=[\"{gres}\"]"))


def test_bf16_on_this_machines_t4_is_refused_before_submission(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    t4 = FakeGpu(used=[0], util=[0], total=16 * GIB, name="Tesla T4", capability=(7, 5))
    monkeypatch.setattr(nvml, "load_nvml", lambda: FakeNvml([t4]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match=r"^memory.amp=bf16 is invalid on GPU 0 of this machine "
                                          r"\(Tesla T4\)"):
        train.check_before_submit(config(tmp_path, *BF16, "parallelism.gpus_per_node=1"))
