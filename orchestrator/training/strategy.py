"""How one model is spread over the ranks: ``ddp`` or ``fsdp`` (``parallelism.strategy``).

- ``ddp``: every rank holds the whole model, its gradients and its optimizer state; gradients are
  all-reduced after backward. With AdamW in fp32 that is 16 bytes per parameter on every GPU.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``). Parameters are DTensors sharded along
  dim 0 over the ranks; each *unit* (a block) is all-gathered just before its forward and backward
  and freed after, and gradients are reduce-scattered, so each rank keeps 1/world of the parameters,
  gradients and optimizer state, plus one unit's full parameters while it runs.

Everything the trainer does differently per strategy is a method here, so the loop reads the same:
``wrap``, ``module`` (the user's model), ``grad_sync`` (skip the reduction on all micro-batches but
the last), ``global_norm``, ``param_checksum`` and ``autocast_amp``: under fsdp the step does not
autocast, as the mixed-precision policy (``mixed_precision``) casts parameters and inputs. Checkpoints differ
too: ddp's rank 0 writes one file (``checkpoint``), fsdp's ranks each write their shards
(``sharded_checkpoint``); ``is_sharded`` picks.

On a GPU the mesh is the rank's CUDA device, so all-gathers and reduce-scatters run over NCCL.
Only rank 0 builds the weights on the host (``Fsdp.build``); the others build on the meta device
and receive their shards, so a GPU only ever allocates its shards and one unit being gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import xxhash
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# FSDP2, DTensor and DCP's state-dict helpers are imported by the fsdp strategy's methods, not
# here: they pull in torch._dynamo (about a second of CPU), which a ddp rank's DDP constructor
# imports anyway but `jobs.train`'s submitting process, which never trains, would pay for nothing.

from orchestrator.config import ConfigError, MemoryConfig, ParallelismConfig
from orchestrator.training import blocks, runtime
from orchestrator.training.runtime import Runtime
from orchestrator.training.step import on_meta


def shard_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules fsdp shards one by one, innermost first (nested units before their parents).

    ``class_names`` (``parallelism.fsdp_units``): every module of one of these classes (plain or
    dotted name); empty: the model's own ``fsdp_units()``, else every module of the classes the
    model names in ``_no_split_modules`` (a Hugging Face model's blocks: ``["GPT2Block"]``, what
    accelerate and HF's own FSDP integration shard by). Raises ConfigError, naming the model and
    the fix, when that gives nothing to shard: the whole model would be all-gathered at once, so
    every GPU would hold all its parameters, which is ddp's memory with more traffic.
    """
    return _units(model, class_names)[0]


def describe_units(model: nn.Module, class_names: list[str]) -> str:
    """What ``shard_units`` chose and why, for the rank log: ``fsdp: 2 units of GPT2Block (the
    model's _no_split_modules)``."""
    units, source = _units(model, class_names)
    classes = ", ".join(sorted({type(m).__name__ for m in units}))
    return f"fsdp: {len(units)} unit{'s' * (len(units) != 1)} of {classes} ({source}), then the root"


def _units(model: nn.Module, class_names: list[str]) -> tuple[list[nn.Module], str]:
    """-> (the units, innermost first; where their choice came from: ``blocks.choose``)."""
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    units, source = blocks.choose(model, class_names)
    if class_names and not units:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"parallelism.fsdp_units={class_names} is invalid: model {name} has no "
                          f"module of these classes (its classes: {', '.join(classes)}; try "
                          f"parallelism.fsdp_units=[<the class of one block>])")
    if source is None:
        raise ConfigError(f"parallelism.strategy='fsdp' has nothing to shard in model {name}: give it "
                          f"an fsdp_units() method returning its blocks, or name their class (try "
                          f"parallelism.fsdp_units=[Block], or parallelism.strategy=ddp)")
    if not any(p.numel() for unit in units for p in unit.parameters()):
        raise ConfigError(f"parallelism.strategy='fsdp' has nothing to shard in model {name}: its "
                          f"units hold no parameters (try parallelism.strategy=ddp)")
    order = {id(m): depth for depth, m in enumerate(model.modules())}
    return sorted(units, key=lambda m: -order[id(m)]), source  # children come after parents in modules()


def mixed_precision(memory: MemoryConfig, parallelism: ParallelismConfig) -> MixedPrecisionPolicy:
    """``memory.amp=bf16``: bf16 parameters in forward and backward (the sharded master copy stays
    fp32), gradients reduced in ``parallelism.fsdp_reduce_dtype`` (fp32 unless set otherwise)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if parallelism.fsdp_reduce_dtype == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if memory.amp == "bf16" else None,
                                reduce_dtype=reduce)


def shard(model: nn.Module, mesh: Any, parallelism: ParallelismConfig, memory: MemoryConfig) -> None:
    """``fully_shard`` each unit (innermost first), then the root, with the run's mixed precision
    and ``parallelism.fsdp_reshard_after_forward`` (the units': FSDP2 never reshards the root after
    forward, whose parameters backward needs first)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(memory, parallelism)
    for unit in shard_units(model, list(parallelism.fsdp_units)):
        fully_shard(unit, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=parallelism.fsdp_reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: what no unit holds


class Ddp:
    is_sharded = False
    name = "ddp"

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def build(self, builder: Callable[[], nn.Module]) -> nn.Module:
        """The model, ready to train: ``builder()`` (seeded alike on every rank), wrapped."""
        return self.wrap(builder())

    def wrap(self, model: nn.Module) -> nn.Module:
        return runtime.wrap(model, self.rt)

    def module(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def settle(self, model: nn.Module, forward: Callable[[nn.Module], torch.Tensor]) -> None:
        """``forward``: the model run on one real example batch (the task's call)."""
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        runtime.settle_buckets(model, forward)

    def grad_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        assert isinstance(model, nn.parallel.DistributedDataParallel)
        return contextlib.nullcontext() if sync else model.no_sync()

    @staticmethod
    def autocast_amp(amp: str) -> str:
        """What the step's autocast runs for ``memory.amp``: ddp autocasts to it."""
        return amp

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm  # DDP's gradients are already the same on every rank

    def param_checksum(self, model: nn.Module) -> str:
        return checksum(self.module(model).named_parameters())


class Fsdp(Ddp):
    is_sharded = True
    name = "fsdp"

    def __init__(self, rt: Runtime, parallelism: ParallelismConfig, memory: MemoryConfig) -> None:
        super().__init__(rt)
        self.parallelism, self.memory = parallelism, memory
        self.unit_classes = list(parallelism.fsdp_units)

    def build(self, builder: Callable[[], nn.Module]) -> nn.Module:
        """Only rank 0 builds the model's weights (on the host, seeded as under ddp, so both start
        from the same weights); every rank builds its structure on the meta device, shards it,
        allocates its own shards on its device and receives them from rank 0's copy, one tensor at
        a time. A node's host memory holds the whole model once, not once per rank: 8 ranks of a 7B
        model would otherwise need 8 x 28 GB of host RAM just to start.

        A model with non-persistent buffers (not in its state dict, so rank 0 cannot send them) is
        built whole on every rank instead, and so is a model whose factory loads its weights
        (``from_pretrained`` refuses the meta device): each rank reads them on the host."""
        if self.rt.env.world_size == 1:
            return self.wrap(builder())
        model = on_meta(builder)
        if model is None or _non_persistent_buffers(model):
            # every rank lands here (the same factory, the same structure), with the seeded random
            # state on_meta left as it found it: one build each draws what ddp's one build draws.
            # A build after rank 0's host build would start from the state that one left, and
            # initialise other weights than ddp does on the same seed.
            return self.wrap(builder())
        full = builder().state_dict() if self.rt.is_main else {}
        after = torch.get_rng_state()
        # every rank leaves with the random state one host build leaves, as every rank does under ddp
        box = [after if self.rt.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        torch.set_rng_state(cast(torch.Tensor, box[0]))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.wrap(model)
        model.to_empty(device=self.rt.device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        if isinstance(model, nn.DataParallel):
            model = model.module
        mesh = init_device_mesh(self.rt.device.type, (self.rt.env.world_size,))
        if self.rt.is_main:
            print(describe_units(model, self.unit_classes), flush=True)
        shard(model, mesh, self.parallelism, self.memory)
        return model

    def module(self, model: nn.Module) -> nn.Module:
        return model

    def settle(self, model: nn.Module, forward: Callable[[nn.Module], torch.Tensor]) -> None:
        pass  # no buckets: each unit reduce-scatters its own gradients in a fixed order

    def grad_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(sync)  # every unit: accumulate unsharded, reduce at the last
        return contextlib.nullcontext()

    @staticmethod
    def autocast_amp(amp: str) -> str:
        """None: the mixed-precision policy casts parameters and inputs; autocast would cast again."""
        return "none"

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm over every rank's shard (a collective: every rank calls it, on the device)."""
        from torch.distributed.tensor import DTensor

        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def param_checksum(self, model: nn.Module) -> str:
        """The same bytes as ddp's checksum of the same weights: each parameter is gathered whole
        (one at a time, a collective every rank runs in the same order).

        Each unit is resharded first: a forward with no backward after it (an evaluation) leaves
        the root's parameters unsharded, as plain tensors in the mixed-precision policy's dtype
        (bf16 under ``memory.amp=bf16``), not the fp32 weights the optimizer holds."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
        return checksum((name, p.full_tensor() if isinstance(p, DTensor) else p)
                        for name, p in sorted(model.named_parameters()))


Strategy = Ddp | Fsdp


def _non_persistent_buffers(model: nn.Module) -> bool:
    return any(module._non_persistent_buffers_set for module in model.modules())


def for_run(rt: Runtime, parallelism: ParallelismConfig, memory: MemoryConfig) -> Strategy:
    return Fsdp(rt, parallelism, memory) if parallelism.strategy == "fsdp" else Ddp(rt)


def autocast_amp(parallelism: ParallelismConfig, memory: MemoryConfig) -> str:
    """``Strategy.autocast_amp`` of the configured strategy, without building it (the estimate)."""
    return (Fsdp if parallelism.strategy == "fsdp" else Ddp).autocast_amp(memory.amp)


def checksum(named: Iterator[tuple[str, torch.Tensor]] | Any) -> str:
    """xxh3 of every parameter's bytes in name order: equal across ranks iff weights are equal."""
    h = xxhash.xxh3_64()
    for name, p in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
