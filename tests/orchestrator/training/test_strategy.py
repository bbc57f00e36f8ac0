"""What fsdp shards, how it casts, what it refuses (multi-rank runs: tests/jobs/test_fsdp.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from rank_helpers import one_rank
from torch import nn
from torch.distributed.tensor import DTensor

from jobs.models import RowPoolingMLP, RowTransformer
from orchestrator.config import (
    ConfigError,
    MemoryConfig,
    MlpConfig,
    ParallelismConfig,
    TrainConfig,
)
from orchestrator.training.strategy import Fsdp, checksum, describe_units, mixed_precision, shard_units


def test_the_built_in_models_shard_each_block() -> None:
    model = RowTransformer(in_features=4, num_classes=3, num_layers=3)
    assert shard_units(model, []) == list(model.blocks)[::-1]  # innermost first, the root last


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(Leaf(), Leaf())
        self.head = nn.Linear(2, 2)


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_named_classes_are_sharded_children_before_their_parents() -> None:
    model = Outer()
    units = shard_units(model, ["Sequential", f"{Leaf.__module__}.Leaf"])
    assert units[-1] is model.inner and set(map(id, units[:2])) == {id(m) for m in model.inner}


def test_a_model_with_nothing_to_shard_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"nothing to shard in model .*Outer: give it an fsdp_units\(\) "
                                          r"method .*parallelism.fsdp_units=\[Block\]"):
        shard_units(Outer(), [])
    with pytest.raises(ConfigError, match=r"parallelism.fsdp_units=\['Block'\] is invalid: model .*Outer "
                                          r"has no module of these classes \(its classes: Leaf, Linear"):
        shard_units(Outer(), ["Block"])
    with pytest.raises(ConfigError, match="its units hold no parameters"):
        shard_units(nn.Sequential(nn.Sequential(nn.ReLU())), ["ReLU"])


class NamesItsBlocks(Outer):
    """As a Hugging Face model names its blocks (``GPT2LMHeadModel._no_split_modules``: a set)."""

    _no_split_modules: ClassVar[set[str]] = {"Leaf"}


class HoldsAnHfModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = NamesItsBlocks()


@pytest.mark.parametrize("build", [NamesItsBlocks, HoldsAnHfModel])
def test_a_model_naming_no_split_modules_is_sharded_per_block_of_its_classes(build: type[nn.Module]) -> None:
    """Without parallelism.fsdp_units it was refused as having nothing to shard."""
    model = build()
    leaves = [m for m in model.modules() if isinstance(m, Leaf)]
    assert set(map(id, shard_units(model, []))) == set(map(id, leaves))
    assert describe_units(model, []) == "fsdp: 2 units of Leaf (the model's _no_split_modules), then the root"


def test_fsdp_units_named_in_the_config_win_over_no_split_modules() -> None:
    model = NamesItsBlocks()
    assert shard_units(model, ["Sequential"]) == [model.inner]
    assert describe_units(model, ["Sequential"]) == \
        "fsdp: 1 unit of Sequential (parallelism.fsdp_units=['Sequential']), then the root"


def test_amp_bf16_is_fsdps_policy_bf16_parameters_fp32_reduction_unless_set() -> None:
    default = mixed_precision(MemoryConfig(amp="bf16"), ParallelismConfig(strategy="fsdp"))
    assert (default.param_dtype, default.reduce_dtype) == (torch.bfloat16, torch.float32)
    cheap = mixed_precision(MemoryConfig(amp="bf16"),
                            ParallelismConfig(strategy="fsdp", fsdp_reduce_dtype="bf16"))
    assert cheap.reduce_dtype == torch.bfloat16
    assert mixed_precision(MemoryConfig(amp="none"), ParallelismConfig(strategy="fsdp")).param_dtype is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"parallelism": ParallelismConfig(strategy="fsdp"), "memory": MemoryConfig(amp="fp16")},
     r"memory.amp='fp16' is invalid: parallelism.strategy=fsdp takes bf16 .*\(try memory.amp=bf16, or "
     r"parallelism.strategy=ddp\)"),
])
def test_a_strategy_with_an_option_it_cannot_support_is_refused_naming_both(
        kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(model=MlpConfig(), **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"strategy": "zero3"}, r"parallelism.strategy='zero3' is invalid: choose one of \('ddp', 'fsdp'\)"),
    ({"fsdp_units": ["Block"]}, r"parallelism.fsdp_units=\['Block'\] is invalid: it applies to "
                                r"parallelism.strategy=fsdp only"),
    ({"fsdp_reduce_dtype": "bf16"}, r"parallelism.fsdp_reduce_dtype='bf16' is invalid: it applies"),
    ({"strategy": "fsdp", "fsdp_reduce_dtype": "fp8"}, r"choose one of \('fp32', 'bf16'\)"),
    ({"fsdp_reshard_after_forward": False}, r"parallelism.fsdp_reshard_after_forward=False is invalid: it "
                                            r"applies to parallelism.strategy=fsdp only"),
])
def test_bad_strategy_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ParallelismConfig(**kwargs)


def test_debug_mode_keeps_the_strategy() -> None:
    from orchestrator.config import ClusterConfig
    cfg = TrainConfig(model=MlpConfig(), cluster=ClusterConfig(mode="debug"),
                      parallelism=ParallelismConfig(strategy="fsdp", procs_per_node=2))
    assert cfg.parallelism.world_size == 1 and cfg.parallelism.strategy == "fsdp"


def test_checksum_is_by_name_and_bytes() -> None:
    a = RowPoolingMLP(in_features=3, num_classes=2)
    b = RowPoolingMLP(in_features=3, num_classes=2)
    b.load_state_dict(a.state_dict())
    assert checksum(a.named_parameters()) == checksum(reversed(list(b.named_parameters())))
    with torch.no_grad():
        b.head.bias[0] += 1e-6
    assert checksum(a.named_parameters()) != checksum(b.named_parameters())


def test_fsdp_keeps_micro_batch_gradients_unreduced_until_the_last(tmp_path: Path) -> None:
    """Gradient accumulation: ``grad_sync(False)`` leaves the reduce-scatter for the last micro-batch
    (the sharded ``.grad`` appears only then), as DDP's ``no_sync`` does."""
    with one_rank(tmp_path) as rt:
        fsdp = Fsdp(rt, ParallelismConfig(strategy="fsdp"), MemoryConfig())
        model = fsdp.wrap(RowPoolingMLP(in_features=3, num_classes=2))
        x, mask = torch.ones(2, 4, 3), torch.ones(2, 4, dtype=torch.bool)
        with fsdp.grad_sync(model, False):
            model(x, mask).sum().backward()
        assert all(p.grad is None for p in model.parameters()), "reduced before the last micro-batch"
        with fsdp.grad_sync(model, True):
            model(x, mask).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert all(isinstance(g, DTensor) for g in grads), "the last micro-batch must reduce-scatter"


def test_an_fsdp_checksum_after_an_evaluation_is_of_the_fp32_weights(tmp_path: Path) -> None:
    """A forward with no backward (an evaluation) leaves the root's parameters unsharded, in the
    mixed-precision policy's dtype. The checksum at the end of an fsdp bf16 run read those: it
    raised "Got unsupported ScalarType BFloat16" on an H200 after the run had trained and saved."""
    with one_rank(tmp_path) as rt:
        fsdp = Fsdp(rt, ParallelismConfig(strategy="fsdp"), MemoryConfig(amp="bf16"))
        torch.manual_seed(0)
        plain = RowPoolingMLP(in_features=3, num_classes=2)
        torch.manual_seed(0)
        model = fsdp.wrap(RowPoolingMLP(in_features=3, num_classes=2))
        with torch.no_grad():
            model(torch.ones(2, 4, 3), torch.ones(2, 4, dtype=torch.bool))
        assert fsdp.param_checksum(model) == checksum(plain.named_parameters())
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("build", "names"), [(HoldsAnHfModel, []), (Outer, ["Leaf"])],
                         ids=["no_split_modules of a submodule", "parallelism.fsdp_units"])
def test_model_compile_compiles_the_blocks_fsdp_shards(build: type[nn.Module], names: list[str]) -> None:
    """One choice of blocks for both: a compiled region never holds an fsdp unit's boundary. The
    compile used its own copy, which read neither the config's classes nor a submodule's
    _no_split_modules, and compiled the whole model instead."""
    from orchestrator.training import compiling

    model = build()
    assert set(map(id, compiling.units(model, names))) == set(map(id, shard_units(model, names)))
    spec = compiling.CompileSpec(enabled=True, backend="eager")
    assert compiling.compile_in_place(model, spec, names) == 2  # counted before fsdp renames the classes


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_reshard_after_forward_reaches_every_unit(tmp_path: Path, reshard: bool) -> None:
    """``parallelism.fsdp_reshard_after_forward=false``: each unit keeps its gathered parameters from
    its forward to its backward (none gathered again); true: they are freed after the forward."""
    with one_rank(tmp_path) as rt:
        fsdp = Fsdp(rt, ParallelismConfig(strategy="fsdp", fsdp_reshard_after_forward=reshard),
                    MemoryConfig(amp="bf16"))
        model = fsdp.wrap(RowPoolingMLP(in_features=3, num_classes=2, num_layers=2))
        out = model(torch.ones(2, 4, 3), torch.ones(2, 4, dtype=torch.bool))
        states = [block._get_fsdp_state()._fsdp_param_group for block in model.blocks]  # type: ignore[operator]
        held = [group.is_unsharded for group in states]  # between forward and backward
        assert held == [not reshard] * 2
        out.float().sum().backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
