"""A model's blocks: what fsdp shards one by one and what ``model.compile`` compiles one by one.

One choice for both, so a compiled region never holds an fsdp unit's boundary: the classes named in
``parallelism.fsdp_units``, else the model's own ``fsdp_units()``, else the classes it (or any of its
submodules, such as a Hugging Face model inside a wrapper) names in ``_no_split_modules``.

Activation checkpointing (``memory.activation_checkpointing``) is per block too: a model's own
``enable_activation_checkpointing()`` (the built-ins checkpoint each of their ``fsdp_units()``), else
a Hugging Face model's (``hugging_face_checkpointing``: each of its decoder or encoder layers, the
classes its ``_no_split_modules`` names).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def choose(model: nn.Module, class_names: list[str]) -> tuple[list[nn.Module], str | None]:
    """-> (the blocks, where their choice came from); ``([], None)`` when the model names none."""
    if class_names:
        return of_classes(model, class_names), f"parallelism.fsdp_units={class_names}"
    if callable(getattr(model, "fsdp_units", None)):
        return list(model.fsdp_units()), "the model's fsdp_units()"  # type: ignore[operator]
    no_split = no_split_modules(model)
    if no_split and (found := of_classes(model, no_split)):
        return found, "the model's _no_split_modules"
    return [], None


def no_split_modules(model: nn.Module) -> list[str]:
    """The block classes a model names in ``_no_split_modules``, its own and its submodules' (a
    wrapper around a Hugging Face model, or a model holding two), in the order first named."""
    names: dict[str, None] = {}
    for module in model.modules():
        for class_name in getattr(module, "_no_split_modules", None) or []:
            if isinstance(class_name, str):
                names[class_name] = None
    return list(names)


def of_classes(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Every module but the root whose class is one of ``class_names`` (plain or dotted names)."""
    wanted = set(class_names)
    return [m for m in model.modules() if m is not model and
            (type(m).__name__ in wanted or f"{type(m).__module__}.{type(m).__qualname__}" in wanted)]


def hugging_face_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``model`` (itself, or inside a wrapper): each has
    transformers' switch for activation checkpointing, which reaches every model inside it."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if callable(getattr(module, "activation_checkpointing_enable", None)) or \
                callable(getattr(module, "gradient_checkpointing_enable", None)):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def hugging_face_checkpointing(models: list[nn.Module]) -> list[str]:
    """Turn on each model's activation checkpointing (transformers 5:
    ``activation_checkpointing_enable``; 4: ``gradient_checkpointing_enable``), non-reentrant as
    the built-ins' (the reentrant kind needs inputs that require grad, and recomputes outside
    DDP's and fsdp's hooks); returns the names of those that do not support it. Each model's layers
    are then recomputed in the backward, one by one."""
    refused = []
    for model in models:
        if not getattr(model, "supports_gradient_checkpointing", False):
            refused.append(type(model).__name__)
            continue
        kwargs = {"use_reentrant": False}
        enable: Any = getattr(model, "activation_checkpointing_enable", None)
        if callable(enable):  # transformers 5; 4's name is deprecated there (a FutureWarning)
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            old: Any = model.gradient_checkpointing_enable
            old(gradient_checkpointing_kwargs=kwargs)
        config: Any = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):  # a training step reads no
            config.use_cache = False  # cache, and transformers warns on every rank that it is off
    return refused


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers a Hugging Face model recomputes in the backward (``gradient_checkpointing``
    set on them): what ``hugging_face_checkpointing`` turned on, seen from the model."""
    return [m for m in model.modules()
            if m is not model and getattr(m, "gradient_checkpointing", False) is True]
