"""Batches to the rank's device the fast way: pinned host memory, copies on their own CUDA stream.

On CUDA the loader pins every batch (``pin_memory=True``), and :func:`to_device` copies batch i+1 to
the GPU on a side stream while the compute stream still works on batch i. The compute stream waits
only for the copy of the batch it is about to use (an event per batch), so the host never blocks on
a copy and the copy engine runs beside the kernels. On CPU the batches pass through unchanged: they
already live where the model does.

Only the fields the step reads are moved; the rest (``index``, lengths) stay on the host, where the
sampler's bookkeeping reads them without touching the GPU.

The side stream is the loader's alone (:func:`copy_stream`). ``torch.cuda.Stream()`` does not create
a stream: it hands out one of a pool of 32 per device and priority, round robin (c10's
``getStreamFromPool``), and NCCL's process group and FSDP2 draw their streams from the same pools.
A pool stream the prefetch shared with an all-reduce would queue each copy behind the collective,
and the compute stream, which waits for the copy, with it. So the copy stream is created by the
CUDA driver itself (``cuStreamCreate``, non-blocking like torch's), once per device for the life of
the process, and handed to torch as an ``ExternalStream``: no pool draw can return it. Where the
driver refuses, a pool stream serves, with a warning: slower at worst.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

Batch = dict[str, torch.Tensor]
CU_STREAM_NON_BLOCKING = 0x1  # no implicit sync with the legacy default stream, as torch's pool streams
_copy_streams: dict[int, torch.cuda.Stream] = {}  # CUDA ordinal -> the loader's copy stream


def to_device(batches: Iterable[Batch], device: torch.device, fields: Sequence[str]) -> Iterator[Batch]:
    """``batches`` with ``fields`` on ``device``, one batch copied ahead on CUDA."""
    if device.type != "cuda":
        yield from batches
        return
    side = copy_stream(device)
    pending: tuple[Batch, torch.cuda.Event] | None = None
    for batch in batches:
        started = _start_copy(batch, device, fields, side)
        if pending is not None:
            yield _hand_over(*pending, device, fields)
        pending = started
    if pending is not None:
        yield _hand_over(*pending, device, fields)


def copy_stream(device: torch.device, driver: Any = None) -> torch.cuda.Stream:
    """The copy stream of ``device`` (a CUDA device with its index): created on first use, the
    same one after (every epoch's loader). ``driver``: the CUDA driver library (tests pass a fake)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        try:
            driver = driver if driver is not None else ctypes.CDLL("libcuda.so.1")  # on any GPU node
            _copy_streams[index] = _new_stream(index, driver)
        except (OSError, RuntimeError) as e:  # slower at worst: the copies may queue behind NCCL's
            warnings.warn(f"the loader's copy stream on cuda:{index} comes from torch's shared stream "
                          f"pool: {e}", stacklevel=2)
            _copy_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _copy_streams[index]


def _new_stream(index: int, driver: Any) -> torch.cuda.Stream:
    """A stream of the driver's, in the device's primary context (the one torch uses)."""
    def check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"CUDA driver call {call} failed on cuda:{index} with CUresult {status}")

    check(driver.cuInit(0), "cuInit")
    dev, ctx, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    check(driver.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    # retained for the process's life: the stream lives in this context
    check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        check(driver.cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    finally:
        check(driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
    return torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", index))


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
