"""The most bytes of arrays a call holds at once, beyond what existed before it: what the
chunked diagonal measures to size its chunks (:meth:`curvgap.models.Chain.diagonal`).

For torch, a dispatch mode follows every tensor storage that an operation creates during the
call until it is freed (any device; functions compiled by ``torch.compile`` run eagerly
while it measures, an upper bound on their compiled peak). For numpy, ``tracemalloc``, to
which numpy reports its buffers."""

from __future__ import annotations

import contextlib
import os
import tracemalloc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveStorages(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their most."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def _follow(self, value: Any) -> None:
        # tensors that hold no memory of their own (fake ones while a module is traced, meta)
        # are not followed
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) \
                or value.device.type == "meta":
            return
        storage = value.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self.sizes or not isinstance(size, int) or size == 0:
            return
        self.sizes[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            self._follow(value)
        return out


def peak_bytes(call: Callable[[], Any], backend: str) -> int:
    """The most bytes of ``backend``'s arrays (``"torch"`` or ``"numpy"``) that ``call()``
    held at once, counting only arrays it created; its result is dropped."""
    if backend == "numpy":
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            call()
            return max(0, tracemalloc.get_traced_memory()[1] - before)
        finally:
            if started:
                tracemalloc.stop()
    stance = (torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance")
              else contextlib.nullcontext())
    with stance, _LiveStorages() as live:
        call()
    return live.peak


def memory_at_hand(device: Any = "cpu") -> int:
    """The memory of ``device`` in bytes: a GPU's total, else the machine's physical memory
    (``/proc/meminfo``'s or sysconf's)."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 2**62


def size_text(count: float) -> str:
    """``count`` bytes as a person reads them (``"1.9 GB"``)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.3g} {unit}"
        count /= 1000
    return ""


def check_room(needed: int, device: Any, what: str, instead: str) -> None:
    """:class:`MemoryError` before any work where ``needed`` bytes (``what``) exceed the
    memory of ``device``, naming the calls that compute it in parts (``instead``)."""
    have = memory_at_hand(device)
    if needed > have:
        raise MemoryError(f"{what} takes {size_text(needed)} ({needed} bytes), more than the "
                          f"{size_text(have)} of memory at hand ({torch.device(device).type}); "
                          f"compute it in parts: {instead}")
