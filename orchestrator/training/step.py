"""One training step's maths, shared by the trainer and the memory estimate (``estimate``): the
builders (model, optimizer, schedule), autocast, one batch's loss, micro-batches with gradient
accumulation, and evaluation's forward passes.

Loss and metrics treat padding entries (``is_pad``, from the sampler's ``pad`` policy) as absent:
they keep every rank's batch count equal without counting any sample twice. Loss sums and sample
counts stay on the batch's device: reading them on the host would stall the GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from orchestrator.config import ConfigError, MemoryConfig, OptimConfig, group_dict, import_target
from orchestrator.training import blocks, compiling, runtime
from orchestrator.training.device_batches import to_device
from orchestrator.training.runtime import Runtime
from orchestrator.training.tasks import Batch, Task

GradSync = Callable[[bool], contextlib.AbstractContextManager[Any]]


def build_model(spec: Any, dataset_kwargs: dict[str, Any], memory: MemoryConfig) -> nn.Module:
    """Instantiate ``spec._target_`` with what the task takes from the dataset (``in_features``
    and ``num_classes``, ``vocab_size``, ...) and the rest of spec as keyword arguments."""
    kwargs, _ = compiling.split(group_dict(spec))  # model.compile*: the trainer's, not the model's
    target = kwargs.pop("_target_", None)
    model_cls = import_target("model", target, "model=mlp, model=transformer, model=gpt")
    try:
        model = model_cls(**dataset_kwargs, **kwargs)
    except TypeError as e:  # an unknown or missing keyword: the user's config, not a bug
        raise ConfigError(f"model._target_={target!r} rejects its arguments: {e} (from the dataset: "
                          f"{sorted(dataset_kwargs)}; from the config: {sorted(kwargs) or 'none'}; "
                          f"fix or remove the model.* key)") from e
    if memory.activation_checkpointing:
        checkpoint_activations(model, target)
    return model


def checkpoint_activations(model: nn.Module, target: str | None) -> None:
    """``memory.activation_checkpointing=true``, per block (``blocks``): the model's own
    ``enable_activation_checkpointing()``, else that of each Hugging Face model in it (it was
    refused: HF models have no method of that name, but one of their own)."""
    own: Any = getattr(model, "enable_activation_checkpointing", None)
    if callable(own):
        own()
        return
    found = blocks.hugging_face_models(model)
    if not found:
        raise ConfigError(f"memory.activation_checkpointing=true but model {target} has no "
                          f"enable_activation_checkpointing(), and holds no Hugging Face model "
                          f"(try memory.activation_checkpointing=false, or give the model an "
                          f"enable_activation_checkpointing() that checkpoints its blocks)")
    refused = blocks.hugging_face_checkpointing(found)
    if refused:
        raise ConfigError(f"memory.activation_checkpointing=true but model {target}'s "
                          f"{', '.join(refused)} does not support activation checkpointing in "
                          f"transformers (supports_gradient_checkpointing=False) (try "
                          f"memory.activation_checkpointing=false)")


def build_model_on_meta(spec: Any, dataset_kwargs: dict[str, Any], memory: MemoryConfig) -> nn.Module:
    """``build_model`` on the meta device: the structure, no weights allocated. A factory that
    loads weights refuses it (transformers' ``from_pretrained``: "You are using `from_pretrained`
    with a meta device context manager"), so it is built on the host instead: its weights are read,
    and held once here while the caller runs."""
    def builder() -> nn.Module:
        return build_model(spec, dataset_kwargs, memory)

    model = on_meta(builder)
    return builder() if model is None else model


def on_meta(builder: Callable[[], nn.Module]) -> nn.Module | None:
    """``builder()`` on the meta device, leaving the random state as it found it; None when the
    factory loads its weights and so refuses the meta device."""
    state = torch.get_rng_state()
    try:
        with torch.device("meta"):
            return builder()
    except RuntimeError as e:
        if not loads_weights(e):
            raise
        return None
    finally:
        torch.set_rng_state(state)


def loads_weights(error: BaseException) -> bool:
    """Whether ``error`` is a model factory refusing the meta device because it loads weights."""
    return isinstance(error, RuntimeError) and "from_pretrained" in str(error) and "meta" in str(error)


def resolved_implementation(cfg: OptimConfig, device: torch.device) -> str:
    """``optim.implementation`` with auto decided: fused on CUDA (both AdamW and SGD have the
    kernel there), foreach elsewhere."""
    if cfg.implementation == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return cfg.implementation


def optimizer_kernels(cfg: OptimConfig, device: torch.device) -> dict[str, bool]:
    """``optim.implementation`` as the optimizer's keyword arguments."""
    chosen = resolved_implementation(cfg, device)
    return {"fused": chosen == "fused", "foreach": chosen == "foreach"}


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """What the optimizer runs (its first group's flags), as ``optim.implementation`` names it."""
    group = optimizer.param_groups[0]
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"


def build_optimizer(params: Any, cfg: OptimConfig, device: torch.device | None = None
                    ) -> torch.optim.Optimizer:
    kernels: dict[str, Any] = dict(optimizer_kernels(cfg, device or torch.device("cpu")))
    try:
        if cfg.name == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay, **kernels)
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernels)
    except RuntimeError as e:  # a fused kernel this device or dtype lacks
        raise ConfigError(unavailable(cfg, device or torch.device("cpu"), e)) from e


def unavailable(cfg: OptimConfig, device: torch.device, error: RuntimeError) -> str:
    """The refusal of a kernel torch lacks here: the value given (and what auto chose), and only
    the choices that run another kernel (auto chose the failing one: offering it again was untrue)."""
    ran = resolved_implementation(cfg, device)
    given = repr(cfg.implementation) + (f" (here: {ran})" if cfg.implementation == "auto" else "")
    others = [f"optim.implementation={name}" for name in ("foreach", "for-loop") if name != ran]
    return f"optim.implementation={given} is not available here: {error} (try {' or '.join(others)})"


def build_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if cfg.schedule == "linear":
            return max(1.0 - progress, 0.0)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager[Any]:
    """``amp``: what autocast runs, as the strategy says (``Strategy.autocast_amp``)."""
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def batch_loss(model: nn.Module, batch: Batch, task: Task, amp: str, denominator: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss for backward, loss sum, unit count) of one batch, all on the batch's device: reading
    them on the host would stall the GPU.

    The loss divides by a fixed denominator (the task's units per micro-batch x accumulation
    steps) rather than by this batch's real count, so k accumulated micro-batches give exactly the
    gradient of one batch k times larger, and padding entries contribute nothing.
    """
    device = batch["is_pad"].device
    with autocast(device, amp):
        output = task.forward(model, batch)
    total, count = task.loss_sums(output, batch)
    return total / denominator, total.detach(), count


def new_sums(device: torch.device) -> torch.Tensor:
    """[loss sum, unit count, real-sample count], accumulated on the device (float64: exact
    counts past 2**24). Units are samples, or tokens for a language model."""
    return torch.zeros(3, dtype=torch.float64, device=device)


def add_to_sums(sums: torch.Tensor, total: torch.Tensor, count: torch.Tensor, samples: torch.Tensor
                ) -> None:
    sums[0] += total  # in place, promoted to float64: small kernels, no allocation
    sums[1] += count
    sums[2] += samples


def backward_micro_batches(model: nn.Module, batches: list[Batch], task: Task, batch_size: int,
                           amp: str, scaler: torch.amp.GradScaler,
                           grad_sync: GradSync | None = None, denominator: float | None = None
                           ) -> torch.Tensor:
    """Accumulate gradients over micro-batches, reducing them only on the last: ``grad_sync(False)``
    around the others (the strategy's; DDP's ``no_sync`` by default). ``amp``: what autocast runs
    (fsdp's own policy casts, so it passes "none"). ``denominator``: the fixed one, when
    ``batches`` are pieces of the loaded batches (``memory.auto_microbatch``).

    Returns [loss sum, unit count, real-sample count] on the batches' device.
    """
    denominator = denominator or task.denominator(batch_size) * len(batches)
    sums = new_sums(batches[0]["is_pad"].device)
    for i, batch in enumerate(batches):
        sync = i == len(batches) - 1
        context = grad_sync(sync) if grad_sync is not None else \
            contextlib.nullcontext() if sync else cast(DistributedDataParallel, model).no_sync()
        with context:
            loss, batch_total, batch_count = batch_loss(model, batch, task, amp, denominator)
            scaler.scale(loss).backward()
        add_to_sums(sums, batch_total, batch_count, (~batch["is_pad"]).sum())
    return sums


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, task: Task, amp: str, rt: Runtime
             ) -> tuple[dict[str, float], int]:
    """(the task's global eval metrics, number of units counted): every eval sample (or window)
    exactly once, padding entries counted in nothing."""
    model.eval()
    sums: torch.Tensor | None = None  # float64 [K] on the device, the task's sums
    for batch in to_device(loader, rt.device, task.fields()):
        with autocast(rt.device, amp):
            output = task.forward(model, batch)
        part = task.eval_sums(output, batch)
        sums = part if sums is None else sums + part
    model.train()
    if sums is None:  # no eval batch on any rank (every rank has the same count)
        return {}, 0
    reduced = runtime.global_sums(rt, sums)  # the one host read of the evaluation
    if not reduced[1]:
        return {}, 0
    return task.eval_metrics(reduced), int(reduced[1])
