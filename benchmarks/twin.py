"""A module's float64 twin: the module run with its float32 casts on the path from the input
and the parameters kept in float64 (an RMSNorm's upcast, an eager softmax's
``dtype=torch.float32``). What it computes apart from that path (rotary tables from
positions, masks) runs as the module makes it. A reference for modules that compute in float32
inside float64 (Llama's RMSNorm, eager attention softmaxes): curvgap computes in the inputs'
dtype, so it agrees with the twin to rounding and with the module to float32's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _Float64Inside(TorchFunctionMode):
    """Casts to float32 of float64 tensors that require a gradient, kept in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dtype == torch.float64 and first.requires_grad:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            if func is torch.Tensor.float:
                return first
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_twin(active: bool = True) -> Iterator[None]:
    """Run modules as their float64 twins while inside (a no-op unless ``active``); the path
    is marked by tensors that require a gradient (the parameters, and ``X`` if it does)."""
    if not active:
        yield
        return
    with _Float64Inside():
        yield
