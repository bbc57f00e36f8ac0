"""``profile_steps`` (``orchestrator.training.profiling``): a real torch.profiler trace of a few
steps of a real one-rank run, and the time by kernel class it reports. CI has no GPU, so the
classes of the kernels a GPU run shows are pinned by their names here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rank_helpers import write_rows_dataset

from orchestrator.config import (
    ConfigError,
    DataConfig,
    LoggerConfig,
    MlpConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.training import profiling, runtime, trainer


@pytest.mark.parametrize(("name", "cls"), [
    # CUDA kernels as an H100/H200 profile of this GPT names them
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4> >(Flash_fwd_params)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
     "::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>",
     "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
     "OpaqueType<2u>, unsigned int, 1, 128, 1>", "memcpy"),  # FSDP2's all-gather copy-in
    ("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel<c10::BFloat16>", "memcpy"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>", "elementwise/norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "elementwise/norm"),
    ("triton_per_fused_native_layer_norm_0", "elementwise/norm"),
    ("triton_poi_fused_add_gelu_1", "elementwise/norm"),
    # the CPU operators a CPU profile shows instead
    ("aten::addmm", "matmul"),
    ("aten::mm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("gloo:all_reduce", "communication"),
    ("aten::native_layer_norm", "elementwise/norm"),
    ("aten::copy_", "memcpy"),
    ("cudaLaunchKernel", "other"),
])
def test_each_kernel_falls_in_its_class(name: str, cls: str) -> None:
    assert profiling.kernel_class(name) == cls


def test_time_by_class_is_per_step_and_names_every_class() -> None:
    rows = [{"name": "aten::mm", "us": 3000.0}, {"name": "aten::addmm", "us": 1000.0},
            {"name": "Memcpy HtoD", "us": 500.0}, {"name": "somethingelse", "us": 500.0}]
    classes = profiling.time_by_class(rows, steps=2)
    assert classes == {"matmul": 2.0, "attention": 0.0, "elementwise/norm": 0.0, "optimizer": 0.0,
                       "communication": 0.0, "memcpy": 0.25, "other": 0.25}
    assert profiling.describe(classes) == "2.50 ms/step: matmul 80 % (2.00 ms), memcpy 10 % (0.25 ms), " \
                                          "other 10 % (0.25 ms)"


def test_a_run_with_profile_steps_writes_a_trace_and_its_classes(rank: runtime.Runtime, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = write_rows_dataset(tmp_path / "data", 64, features=5, classes=3, max_rows=8)
    # after the first window (2 steps) and a warm-up step: steps 4 and 5
    cfg = TrainConfig(model=MlpConfig(), data=DataConfig(path=data, num_classes=3, batch_size=8),
                      optim=OptimConfig(max_steps=6), log_every_steps=2, profile_steps=2,
                      logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))
    trainer.Trainer(cfg, trainer.DataPaths(train=data, eval=None), tmp_path, rank).run()
    trace = json.loads((tmp_path / "profile" / "rank-0.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}  # 0-based: the 4th and 5th steps
    found = json.loads((tmp_path / "profile" / "rank-0.kernels.json").read_text())
    assert found["device"] == "cpu" and found["steps"] == 2
    classes = found["ms_per_step_by_class"]
    assert classes["matmul"] > 0 and classes["optimizer"] > 0 and classes["communication"] > 0  # DDP's
    assert "profile: 2 steps in " in capsys.readouterr().out


def test_without_profile_steps_nothing_is_profiled(tmp_path: Path) -> None:
    profiler = profiling.StepProfiler(0, 2, tmp_path, 0, torch.device("cpu"), True)
    with profiler:
        profiler.step()
    assert profiler.prof is None and not (tmp_path / "rank-0.trace.json").exists()
    with pytest.raises(ConfigError, match=r"profile_steps=-1 is invalid: must be >= 0"):
        TrainConfig(profile_steps=-1)
