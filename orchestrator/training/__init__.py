"""What each rank does, once it runs.

- ``rank_process``: the rank's entry point (``train_rank``): start-up and shutdown around the loop;
- ``trainer``: the training loop, which knows no task, no checkpoint format and no strategy;
- ``step``: one step's maths (builders, autocast, loss, micro-batches, evaluation's forward passes),
  shared with the memory estimate (``estimate``);
- ``loaders``, ``metrics``, ``nonfinite``, ``memory_report``: the rank's data, the metrics window
  and peaks, the NaN/inf guard, the memory section of the summary;
- ``train_state``: what a checkpoint holds besides the weights, from components that save and
  restore themselves;
- ``runtime``: the device and the process group, DDP wrapping, reductions over ranks;
- ``checkpoint``: atomic save, newest-readable load;
- ``preemption``: SIGUSR2/SIGTERM to a flag all ranks agree on at a step boundary, then requeue.

It may use ``launch`` (who am I, where is rank 0) and ``telemetry``; it never imports ``sweeps``.
"""

from __future__ import annotations

import re

import torch

# fully_shard and FSDPModule (public in torch.distributed.fsdp) and nn.utils.get_total_norm, which
# every run imports, arrived in torch 2.6.
TORCH_FLOOR = (2, 6)


class TorchVersionError(ImportError):
    """The installed torch is older than :data:`TORCH_FLOOR`; its message is one line."""


def check_torch_version(version: str) -> None:
    """Raises :class:`TorchVersionError` (``name="torch"``, so an entry point can tell it from
    another import error) naming the version found and the one needed."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= TORCH_FLOOR:
        return  # a version string torch never used (a source build's): let the imports decide
    need = ".".join(map(str, TORCH_FLOOR))
    raise TorchVersionError(
        f"torch {version} is installed but Switchyard needs torch>={need} (fully_shard, FSDPModule, "
        f"nn.utils.get_total_norm): install torch>={need} (the wheel matching your CUDA) before Switchyard",
        name="torch")


# Here, before any module of this package imports what 2.6 added: a too-old torch is one line.
check_torch_version(torch.__version__)
