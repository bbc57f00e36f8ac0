"""Model FLOPs per second and MFU (model FLOPs utilisation) for models that state their FLOPs.

A model with ``flops_per_token()`` (the built-in GPT: 6 per parameter plus causal attention) gets
``model_tflops_per_s`` on every device, and ``mfu`` where the GPU's peak for the run's precision is
known: the table below, dense (no 2:4 sparsity) figures from NVIDIA's data sheets. Anywhere else
``mfu`` is null, never a made-up ratio (MFU above 100% from a wrong peak is a common bug).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# TFLOP/s per GPU, dense. An fp32 run uses "tf32" under memory.tf32=true (the default), plain
# "fp32" otherwise.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0},
}


def peak_tflops(device_name: str, amp: str, tf32: bool = False) -> float | None:
    """The peak of a GPU whose name contains a key of the table (the longest match), or None."""
    precision = ("tf32" if tf32 else "fp32") if amp == "none" else amp
    matches = [key for key in PEAK_TFLOPS if all(part in device_name for part in key.split())]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(precision)


def throughput_for(model: torch.nn.Module, device: torch.device, amp: str, world_size: int,
                   tf32: bool = False) -> Callable[[float], dict[str, float | None]]:
    """A function of the global units (tokens) per second -> ``model_tflops_per_s`` (all ranks
    together) and ``mfu`` (that over the peak of every rank's GPU); nothing for a model that
    states no FLOPs."""
    flops = getattr(model, "flops_per_token", None)
    if not callable(flops):
        inner = getattr(model, "module", None)  # DDP wraps it
        flops = getattr(inner, "flops_per_token", None)
    if not callable(flops):
        return lambda rate: {}
    per_token = float(flops())
    peak = peak_tflops(torch.cuda.get_device_name(device), amp, tf32) if device.type == "cuda" else None

    def measure(tokens_per_s: float) -> dict[str, float | None]:
        achieved = per_token * tokens_per_s / 1e12
        return {"model_tflops_per_s": achieved,
                "mfu": achieved / (peak * world_size) if peak else None}

    return measure
