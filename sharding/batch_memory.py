"""Where a batch's memory comes from: one block per batch, carved into its tensors.

Every batch the loader builds (data, lengths, masks, index, is_pad) is views into one block of
bytes laid out by a ``BatchLayout``. The block comes from one of three places:

- in the main process (``num_workers=0``): ``BufferPool``, a few reused buffers, cache-line
  aligned and on 2 MiB pages where the kernel allows (``huge_page_buffer``);
- in a DataLoader worker started by ``make_loader``: a slot of that worker's ``BatchRing``,
  shared memory mapped once by the worker and the main process and reused batch after batch;
- in a worker with no free slot (or no ring): ``shared_block``, fresh shared memory, which
  torch sends to the main process as one file descriptor, as it sends any shared tensor.

Why not fresh memory every time: filling a multi-MB tensor on fresh pages page-faults on every
4 KiB page and the kernel zeroes each one first. On the project VM a fresh page cost about 3 us
in-process and 6 us in shared memory, so an 8 MB batch paid 6-12 ms of faults to be filled in
about 1 ms, and each shared block cost another 0.2-0.8 ms to hand over (a file descriptor passed
through torch's resource sharer, then mapped again). A ring slot costs neither after first use:
the worker sends three numbers (ring, slot, layout) and the main process already has the map.

Safety of reuse: memory is handed out again only once no tensor of the batch it held is alive.
A batch's block is a new numpy array per batch (``np.frombuffer`` of a memoryview), so numpy
makes it the ``.base`` of every array cut from it, and ``torch.from_numpy`` of those arrays
keeps them, and so the block, alive, as do any views of the tensors. A weak reference to the
block (in-process pool) or a finalizer on it (ring slot) fires exactly when the last tensor,
or view of one, is gone. A caller that keeps batches is safe: the pool then allocates a fresh
block, the worker takes fresh shared memory. A ring slot's release travels to its worker through
a pipe (a 2-byte write, atomic), so the worker sees it only after the main process has stopped
reading the slot, on any CPU architecture (the kernel's pipe orders the two).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing
import os
import struct
import threading
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np
import torch

from sharding.format import DatasetError

ALIGN = 64  # every part of a block starts on a cache line: aligned for any dtype view
PAGE = mmap.PAGESIZE  # ring slots start on a page


class Part(NamedTuple):
    key: str
    dtype: str  # numpy dtype name: pickles small, maps to torch below
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the block


class BatchLayout(NamedTuple):
    """Where each tensor of a batch lies in its block; small and picklable."""

    parts: tuple[Part, ...]
    nbytes: int


def batch_layout(specs: Sequence[tuple[str, np.dtype[Any], tuple[int, ...]]]) -> BatchLayout:
    """(key, dtype, shape) in batch key order -> the parts, each aligned to ``ALIGN`` bytes.

    ``nbytes`` never shrinks when a shape grows, so the layout of the largest possible batch
    bounds every batch (what a ring slot is sized by).
    """
    parts, offset = [], 0
    for key, dtype, shape in specs:
        offset = -(-offset // ALIGN) * ALIGN
        parts.append(Part(key, np.dtype(dtype).str, tuple(shape), offset))
        offset += math.prod(shape) * np.dtype(dtype).itemsize
    return BatchLayout(tuple(parts), offset)


def numpy_views(block: np.ndarray, layout: BatchLayout) -> dict[str, np.ndarray]:
    """The layout's arrays over ``block`` (uint8), for filling."""
    out = {}
    for key, dtype, shape, offset in layout.parts:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        out[key] = block[offset : offset + size].view(dtype).reshape(shape)
    return out


def tensor_views(block: torch.Tensor, layout: BatchLayout) -> dict[str, torch.Tensor]:
    """The layout's tensors over ``block`` (uint8): views that share the block's storage."""
    out = {}
    for key, dtype, shape, offset in layout.parts:
        torch_dtype = _TORCH_DTYPES.get(dtype) or _torch_dtype(dtype)
        size = math.prod(shape) * torch_dtype.itemsize
        out[key] = block[offset : offset + size].view(torch_dtype).view(shape)
    return out


_TORCH_DTYPES: dict[str, torch.dtype] = {}


def _torch_dtype(name: str) -> torch.dtype:
    _TORCH_DTYPES[name] = torch.from_numpy(np.empty(0, name)).dtype
    return _TORCH_DTYPES[name]


SHM_DIR = "/dev/shm"  # where torch's shared memory lives on Linux (shm_open)


class SharedMemoryError(DatasetError):
    """The batch rings do not fit in the shared-memory file system."""


def shm_free_bytes() -> int | None:
    """Free bytes of the shared-memory file system; None where there is none to ask."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """torch's shared memory of ``nbytes``, or a DatasetError when the file system cannot hold it.

    torch creates ``/dev/shm/torch_<pid>_*``, then reserves the whole size (posix_fallocate); when
    that fails (ENOSPC) it raises without removing the file, which then holds the space until
    reboot. So a failure here removes the files this process created meanwhile.
    """
    before = _own_shm_files()
    try:
        return torch.UntypedStorage._new_shared(nbytes)
    except RuntimeError as e:
        for leaked in _own_shm_files() - before:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, leaked))
        free = shm_free_bytes()
        raise SharedMemoryError(
            f"cannot allocate {nbytes / 1e6:,.0f} MB of shared memory in {SHM_DIR} ({e}; "
            f"{'unknown' if free is None else f'{free / 1e6:,.0f} MB'} free): lower data.batch_size "
            f"or data.num_workers, set data.num_workers=0, or give the job a larger {SHM_DIR} "
            f"(containers: --shm-size)") from e


def _own_shm_files() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(f"torch_{os.getpid()}_")}
    except OSError:
        return set()



def shared_block(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` over fresh shared memory: what a worker without a free slot
    builds its batch in (as default_collate does in workers), sent as one file descriptor."""
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


class BufferPool:
    """Hands out uint8 blocks over a few reused buffers: batch memory that stays mapped.

    Why: a fresh multi-MB batch often lands on pages the allocator just gave back to the kernel
    (glibc trims the top of its heap on free), so filling it page-faults on every 4 KiB page
    and the kernel zeroes each one first: measured here ~270 faults per 64-sample batch, half
    the batch time. Each ``block`` is a new array over a buffer (``np.frombuffer`` of a
    memoryview, so numpy makes it the ``.base`` of every view cut from it, and the tensors
    ``torch.from_numpy`` makes of those views keep it alive). The pool watches each block
    through a weak reference and reuses its buffer only once the block, and so every tensor
    and view of the batch, is gone. When all ``max_buffers`` are in use (a caller keeping
    batches) it allocates a fresh block. Of the free buffers that fit, the lowest is reused.
    """

    def __init__(self, max_buffers: int = 4) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []  # uint8 [capacity] each
        self._users: list[weakref.ref[np.ndarray] | None] = []  # the block last handed out
        self._lock = threading.Lock()  # a claim is a check and a set: one thread at a time

    def block(self, num_bytes: int) -> np.ndarray:
        """uint8 [num_bytes], uninitialized; see the class docstring for when it is reused."""
        with self._lock:
            slot = self._free_slot(num_bytes)
            if slot is None:
                return huge_page_buffer(num_bytes)
            block = np.frombuffer(self._buffers[slot].data[:num_bytes], np.uint8)
            self._users[slot] = weakref.ref(block)
        return block

    def _free_slot(self, num_bytes: int) -> int | None:
        free = [k for k, user in enumerate(self._users) if user is None or user() is None]
        for k in free:
            if self._buffers[k].nbytes >= num_bytes:
                return k
        if len(self._buffers) < self.max_buffers:
            self._buffers.append(np.empty(0, np.uint8))
            self._users.append(None)
            free.append(len(self._buffers) - 1)
        if not free:
            return None
        self._buffers[free[0]] = huge_page_buffer(num_bytes)  # grow: batches vary in length
        return free[0]


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``torch.from_numpy`` of each array: zero-copy, and each tensor keeps its array alive."""
    return {key: torch.from_numpy(array) for key, array in arrays.items()}


HUGE_PAGE = 2 << 20


def huge_page_buffer(num_bytes: int) -> np.ndarray:
    """uint8 [num_bytes] of private memory, cache-line aligned, on 2 MiB pages where possible.

    Why, measured on the project VM filling padded batches (median samples/s): 82k into
    ``np.empty`` memory, 92k into the same size mapped page-aligned, 102k page-aligned with
    ``MADV_HUGEPAGE``. ``np.empty``'s data starts 16 bytes into a page, so every row of a batch
    straddles one more cache line than it needs; and Linux's default
    ``transparent_hugepage=madvise`` gives 2 MiB pages (one TLB entry, not 512) only to a
    private mapping that asks. Below 2 MiB: ``np.empty`` with the start moved to a cache line.
    """
    if num_bytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        whole = np.empty(num_bytes + ALIGN, np.uint8)
        start = -whole.ctypes.data % ALIGN
        return whole[start : start + num_bytes]
    size = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous; slack to align
    whole = np.frombuffer(region, np.uint8)  # keeps the map alive as long as any view of it
    start = -whole.ctypes.data % HUGE_PAGE
    with contextlib.suppress(OSError):  # advice only: a kernel without THP still gives memory
        region.madvise(mmap.MADV_HUGEPAGE, start, size)
    return whole[start : start + num_bytes]


# ------------------------------------------------------------------------------------------------
# The ring: per-worker slots in shared memory, reused once the main process drops the batch


_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()  # main process


class BatchRing:
    """``num_slots`` slots of ``slot_bytes`` in one shared-memory block, for one worker.

    The main process creates it before the worker starts (``make_loader``'s DataLoader does),
    so the worker inherits the map (fork) or receives it once (spawn, forkserver). The worker
    ``claim``s a free slot, builds a batch in it and returns a ``RingBatch``, which pickles as
    (ring, slot, layout). The main process turns that back into tensors over its own map of the
    slot (``_open_slot``) and, when the last of them is gone, writes the slot number into the
    ring's pipe; the worker reads it at its next claim. torch reserves the whole block in
    /dev/shm when it is made (posix_fallocate), so the loader checks that every ring fits first
    (``loader.ring_bytes``, ``loader.check_shared_memory``).
    """

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        if num_slots < 1 or num_slots > 0xFFFF:
            raise ValueError(f"num_slots={num_slots} is invalid: must be 1..65535")
        self.token = uuid.uuid4().hex
        self.slot_bytes = max(-(-slot_bytes // PAGE) * PAGE, PAGE)  # slots start on a page
        self.num_slots = num_slots
        self.storage = new_shared_storage(self.slot_bytes * num_slots)
        self._released, writer = multiprocessing.Pipe(duplex=False)
        self._release_writer: Connection | None = writer  # main process only
        os.set_blocking(writer.fileno(), False)  # a finalizer never waits
        self._init_process_state()
        _RINGS[self.token] = self

    def _init_process_state(self) -> None:
        self._array: np.ndarray | None = None  # this process's uint8 view of the block
        self._free = list(range(self.num_slots - 1, -1, -1))  # worker side: a stack, 0 on top
        self._reader_ready = False

    def __getstate__(self) -> dict[str, Any]:
        """What the worker receives (spawn): the block and the read end, never the write end."""
        state = self.__dict__.copy()
        for key in ("_release_writer", "_array", "_free", "_reader_ready"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._release_writer = None
        self._init_process_state()

    def array(self) -> np.ndarray:
        if self._array is None:
            whole = torch.empty(0, dtype=torch.uint8).set_(self.storage, 0, (self.storage.nbytes(),), (1,))
            self._array = whole.numpy()
        return self._array

    # -- worker side ---------------------------------------------------------------------------

    def claim(self, nbytes: int) -> int | None:
        """A slot to build a batch of ``nbytes`` in, or None (too big, or every slot in use)."""
        if nbytes > self.slot_bytes:
            return None
        self._collect_releases()
        return self._free.pop() if self._free else None

    def _collect_releases(self) -> None:
        fd = self._released.fileno()
        if not self._reader_ready:
            os.set_blocking(fd, False)
            self._reader_ready = True
        while True:
            try:
                data = os.read(fd, 4096)  # whole 2-byte records: each write is atomic, 4096 even
            except BlockingIOError:
                return
            if not data:  # the main process is gone
                return
            self._free.extend(struct.unpack(f"<{len(data) // 2}H", data))

    def batch(self, slot: int, layout: BatchLayout, arrays: dict[str, np.ndarray]) -> RingBatch:
        """The batch filled in ``slot`` (its ``arrays``), as a RingBatch for the main process."""
        return RingBatch(as_tensors(arrays), (self.token, slot, layout))

    def slot(self, slot: int, nbytes: int) -> np.ndarray:
        """uint8 [nbytes] at the start of ``slot``: a new array (the base of views cut from it)."""
        start = slot * self.slot_bytes
        return np.frombuffer(self.array().data[start : start + nbytes], np.uint8)

    # -- main-process side --------------------------------------------------------------------

    def open(self, slot: int, layout: BatchLayout) -> dict[str, torch.Tensor]:
        """The batch in ``slot`` as tensors over this process's map; the slot returns to the
        worker when the last of them (or of their views) is gone."""
        if not 0 <= slot < self.num_slots or layout.nbytes > self.slot_bytes:
            raise DatasetError(f"a worker sent slot {slot} with {layout.nbytes} bytes, but its ring "
                               f"has {self.num_slots} slots of {self.slot_bytes} bytes: a bug to report")
        block = self.slot(slot, layout.nbytes)
        finalizer = weakref.finalize(block, self._release, slot)
        finalizer.atexit = False  # at exit the worker is gone: nothing to tell it
        return as_tensors(numpy_views(block, layout))

    def _release(self, slot: int) -> None:
        writer = self._release_writer
        if writer is None:
            return
        # The worker has exited, or the pipe is full: the slot stays taken, nothing else breaks.
        with contextlib.suppress(OSError):
            os.write(writer.fileno(), struct.pack("<H", slot))


class RingBatch(dict[str, torch.Tensor]):
    """A worker's batch in a ring slot: a dict of tensors that pickles as (ring, slot, layout).

    Only the DataLoader's result queue pickles it; what the main process receives is a plain
    dict of tensors over its own map of the slot.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], where: tuple[str, int, BatchLayout]) -> None:
        super().__init__(tensors)
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return _open_slot, self.where


def _open_slot(token: str, slot: int, layout: BatchLayout) -> dict[str, torch.Tensor]:
    ring = _RINGS.get(token)
    if ring is None:
        raise DatasetError(
            f"a batch names shared-memory ring {token}, which this process does not have: "
            "batches built in ring slots can only be received by the process running the "
            "DataLoader that started the worker"
        )
    return ring.open(slot, layout)
