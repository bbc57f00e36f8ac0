"""Batches to the rank's device the fast way: pinned host memory, copies on their own CUDA stream.

On CUDA the loader pins every batch (``pin_memory=True``), and :func:`to_device` copies batch i+1 to
the GPU on a side stream while the compute stream still works on batch i. The compute stream waits
only for the copy of the batch it is about to use (an event per batch), so the host never blocks on
a copy and the copy engine runs beside the kernels. On CPU the batches pass through unchanged: they
already live where the model does.

Only the fields the step reads are moved; the rest (``index``, lengths) stay on the host, where the
sampler's bookkeeping reads them without touching the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

Batch = dict[str, torch.Tensor]


def to_device(batches: Iterable[Batch], device: torch.device, fields: Sequence[str]) -> Iterator[Batch]:
    """``batches`` with ``fields`` on ``device``, one batch copied ahead on CUDA."""
    if device.type != "cuda":
        yield from batches
        return
    copy_stream = torch.cuda.Stream(device)
    pending: tuple[Batch, torch.cuda.Event] | None = None
    for batch in batches:
        started = _start_copy(batch, device, fields, copy_stream)
        if pending is not None:
            yield _hand_over(*pending, device, fields)
        pending = started
    if pending is not None:
        yield _hand_over(*pending, device, fields)


def _start_copy(batch: Batch, device: torch.device, fields: Sequence[str],
                copy_stream: torch.cuda.Stream) -> tuple[Batch, torch.cuda.Event]:
    with torch.cuda.stream(copy_stream):
        moved = {k: v.to(device, non_blocking=True) if k in fields else v for k, v in batch.items()}
        copied = torch.cuda.Event()
        copied.record(copy_stream)
    return moved, copied


def _hand_over(batch: Batch, copied: torch.cuda.Event, device: torch.device,
               fields: Sequence[str]) -> Batch:
    compute = torch.cuda.current_stream(device)
    compute.wait_event(copied)  # on the GPU: the kernels of this step start after its copy, the host goes on
    for k in fields:
        if k in batch:
            # memory made on the copy stream is used on the compute stream: keep the allocator from
            # handing it out again before the compute stream is done with it
            batch[k].record_stream(compute)
    return batch
