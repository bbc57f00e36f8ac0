"""The prefetch's copy stream is the loader's own, on a CPU machine: the CUDA driver faked.

``torch.cuda.Stream()`` draws from the pool NCCL and FSDP draw from; the loader's stream is made by
the driver instead (``cuStreamCreate``), once per device. ``tests/gpu/test_train_gpu.py`` checks on a
GPU that no pool draw returns it.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from orchestrator.training import device_batches


class FakeDriver:
    """The five libcuda calls the loader makes, recorded; ``fail``: the call that returns an error."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail
        self.next_stream = 0x7F00

    def _status(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        return 700 if name == self.fail else 0

    def cuInit(self, flags: int) -> int:
        return self._status("cuInit", flags)

    def cuDeviceGet(self, dev: Any, ordinal: int) -> int:
        dev._obj.value = 100 + ordinal
        return self._status("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, ctx: Any, dev: ctypes.c_int) -> int:
        ctx._obj.value = 0xC000 + dev.value
        return self._status("cuDevicePrimaryCtxRetain", dev.value)

    def cuCtxPushCurrent_v2(self, ctx: ctypes.c_void_p) -> int:
        return self._status("cuCtxPushCurrent_v2", ctx.value)

    def cuStreamCreate(self, stream: Any, flags: int) -> int:
        self.next_stream += 0x10
        stream._obj.value = self.next_stream
        return self._status("cuStreamCreate", flags)

    def cuCtxPopCurrent_v2(self, ctx: Any) -> int:
        return self._status("cuCtxPopCurrent_v2")


@pytest.fixture(autouse=True)
def fake_external_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_batches, "_copy_streams", {})
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda ptr, device: SimpleNamespace(cuda_stream=ptr, device=device))


def test_the_copy_stream_is_made_by_the_driver_in_the_devices_context_once() -> None:
    driver = FakeDriver()
    first = device_batches.copy_stream(torch.device("cuda", 1), driver)
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 101),
                            ("cuCtxPushCurrent_v2", 0xC065), ("cuStreamCreate", 0x1), ("cuCtxPopCurrent_v2",)]
    assert (first.cuda_stream, first.device) == (0x7F10, torch.device("cuda", 1))
    assert device_batches.copy_stream(torch.device("cuda", 1), driver) is first  # every epoch: the same
    assert len(driver.calls) == 6
    other = device_batches.copy_stream(torch.device("cuda", 0), driver)
    assert other.cuda_stream != first.cuda_stream and other.device == torch.device("cuda", 0)


def test_a_driver_error_is_named_and_the_pool_serves_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slower at worst, never a failed run: the context is left as it was, the warning says why."""
    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device: SimpleNamespace(cuda_stream="pool", device=device))
    driver = FakeDriver(fail="cuStreamCreate")
    with pytest.warns(UserWarning, match=r"^the loader's copy stream on cuda:2 comes from torch's shared "
                                         r"stream pool: CUDA driver call cuStreamCreate failed on cuda:2 "
                                         r"with CUresult 700"):
        stream = device_batches.copy_stream(torch.device("cuda", 2), driver)
    assert driver.calls[-1] == ("cuCtxPopCurrent_v2",)
    assert (stream.cuda_stream, stream.device) == ("pool", torch.device("cuda", 2))
