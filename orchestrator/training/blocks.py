"""A model's blocks: what fsdp shards one by one and what ``model.compile`` compiles one by one.

One choice for both, so a compiled region never holds an fsdp unit's boundary: the classes named in
``parallelism.fsdp_units``, else the model's own ``fsdp_units()``, else the classes it (or any of its
submodules, such as a Hugging Face model inside a wrapper) names in ``_no_split_modules``.
"""

from __future__ import annotations

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
