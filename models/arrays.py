"""The array calls a chain makes beyond its parts' generated functions, one object per
backend (:data:`ARRAYS`: ``"torch"``, ``"numpy"``), so that the sweeps read the same for both;
and the results written into their slice of a flat array (:func:`written`).

Results are computed in float32 where the inputs are float16 or bfloat16 (:meth:`wide`, the
generated modules' own widening, :mod:`curvgap.runtime`) and cast back to the inputs' dtype at
the end (:meth:`cast`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..runtime import numpy_arrays, torch_arrays

Array = Any  # a torch tensor, or a numpy array for the numpy backend


def written(array: Array, value: Array) -> None:
    """``value`` (of ``array``'s size) in the 1-D ``array``: copied there unless it is there
    already (a result written into its slice of a flat array)."""
    if isinstance(array, torch.Tensor):
        there = (value.data_ptr() == array.data_ptr() and value.is_contiguous()
                 and value.numel() == array.numel() and value.dtype == array.dtype)
        if not there:
            array.copy_(value.reshape(-1))
    elif not (value.ctypes.data == array.ctypes.data and value.flags.c_contiguous
              and value.size == array.size and value.dtype == array.dtype):
        array[...] = value.reshape(-1)


def flat_slots(arrays: NumpyArrays | TorchArrays, sizes: list[tuple[Any, int]], like: Array,
               columns: int | None = None) -> tuple[Array, dict]:
    """An empty result over the blocks ``sizes`` (``(key, entries)``, in order) in ``like``'s
    dtype (and device), ``(n,)`` or ``(n, columns)``, and for ``(n,)`` key → its block's slice:
    where a result over that block is written (:func:`written`)."""
    n = sum(size for _, size in sizes)
    flat = arrays.empty(n if columns is None else (n, columns), like)
    slots, offset = {}, 0
    for key, size in sizes:
        if columns is None:
            slots[key] = flat[offset:offset + size]
        offset += size
    return flat, slots


class NumpyArrays:
    """numpy's calls (arrays on the CPU)."""

    def cat(self, arrays: list[Array], axis: int = 0) -> Array:
        return np.concatenate(arrays, axis=axis)

    def stack(self, arrays: list[Array], axis: int = 0) -> Array:
        return np.stack(arrays, axis)

    def zeros(self, shape: tuple[int, ...], like: Array) -> Array:
        return np.zeros(shape, dtype=like.dtype)

    def empty(self, n: int | tuple[int, ...], like: Array) -> Array:
        return np.empty(n, dtype=like.dtype)

    def eye(self, n: int, like: Array) -> Array:
        return np.eye(n, dtype=like.dtype)

    def unit(self, n: int, start: int, count: int, like: Array) -> Array:
        """Columns ``start … start + count − 1`` of the ``n × n`` identity as rows,
        ``(count, n)``; rows past ``n`` are zero."""
        E = np.zeros((count, n), dtype=like.dtype)
        rows = np.arange(min(count, n - start))
        E[rows, rows + start] = 1
        return E

    def tile(self, a: Array, copies: int) -> Array:
        """``a`` (a batch of one) repeated ``copies`` times along its first axis."""
        return np.repeat(a, copies, axis=0)

    def cast(self, value: Array, like: Array) -> Array:
        """``value`` in the dtype of ``like``."""
        return numpy_arrays._cast(value, like.dtype)

    def wide(self, a: Any) -> Any:
        """``a`` in the dtype it is computed in (float16 in float32; anything else, such as
        ``None``, as it is)."""
        return numpy_arrays._widened(a) if isinstance(a, np.ndarray) else a

    def itemsize(self, like: Array) -> int:
        """The bytes of one entry of ``like``'s dtype."""
        return like.dtype.itemsize

    def device(self, like: Array) -> Any:
        return "cpu"

    def index_add(self, value: Array, axis: int, index: np.ndarray, n: int) -> Array:
        """``value`` with its ``axis`` summed into ``n`` entries, entry ``i`` into
        ``index[i]``."""
        shape = list(value.shape)
        shape[axis] = n
        out = np.zeros(shape, dtype=value.dtype)
        np.add.at(out, (slice(None),) * (axis % value.ndim) + (index,), value)
        return out

    def eigh_by_magnitude(self, M: Array) -> tuple:
        """``(λ, U, |λ|, order, eps)``: the eigenvalues and eigenvectors of the symmetric
        ``M`` per sample, their magnitudes, the order of those from the largest, and the
        machine epsilon of ``M``'s dtype."""
        values, vectors = np.linalg.eigh(M)
        magnitude = np.abs(values)
        return values, vectors, magnitude, np.argsort(-magnitude, axis=-1), np.finfo(M.dtype).eps

    def largest(self, a: Array) -> Array:
        """The largest entry along the last axis, that axis kept."""
        return a.max(-1, keepdims=True)

    def take(self, a: Array, index: Array) -> Array:
        """``a``'s entries at ``index`` along the last axis."""
        return np.take_along_axis(a, index, axis=-1)


class TorchArrays:
    """torch's calls (on the device of the tensors given)."""

    def cat(self, arrays: list[Array], axis: int = 0) -> Array:
        return torch.cat(arrays, dim=axis)

    def stack(self, arrays: list[Array], axis: int = 0) -> Array:
        return torch.stack(arrays, axis)

    def zeros(self, shape: tuple[int, ...], like: Array) -> Array:
        return torch.zeros(*shape, dtype=like.dtype, device=like.device)

    def empty(self, n: int | tuple[int, ...], like: Array) -> Array:
        return torch.empty(n, dtype=like.dtype, device=like.device)

    def eye(self, n: int, like: Array) -> Array:
        return torch.eye(n, dtype=like.dtype, device=like.device)

    def unit(self, n: int, start: int, count: int, like: Array) -> Array:
        """Columns ``start … start + count − 1`` of the ``n × n`` identity as rows,
        ``(count, n)``; rows past ``n`` are zero."""
        E = torch.zeros(count, n, dtype=like.dtype, device=like.device)
        rows = torch.arange(min(count, n - start), device=like.device)
        E[rows, rows + start] = 1
        return E

    def tile(self, a: Array, copies: int) -> Array:
        """``a`` (a batch of one) repeated ``copies`` times along its first axis."""
        return a.repeat(copies, *([1] * (a.ndim - 1)))

    def cast(self, value: Array, like: Array) -> Array:
        """``value`` in the dtype of ``like``."""
        return torch_arrays._cast(value, like.dtype)

    def wide(self, a: Any) -> Any:
        """``a`` in the dtype it is computed in (float16 and bfloat16 in float32; anything
        else, such as ``None``, as it is)."""
        return torch_arrays._widened(a) if isinstance(a, torch.Tensor) else a

    def itemsize(self, like: Array) -> int:
        """The bytes of one entry of ``like``'s dtype."""
        return like.element_size()

    def device(self, like: Array) -> Any:
        return like.device

    def index_add(self, value: Array, axis: int, index: np.ndarray, n: int) -> Array:
        """``value`` with its ``axis`` summed into ``n`` entries, entry ``i`` into
        ``index[i]``."""
        shape = list(value.shape)
        shape[axis] = n
        return value.new_zeros(shape).index_add_(
            axis, torch.as_tensor(index, device=value.device), value)

    def eigh_by_magnitude(self, M: Array) -> tuple:
        """``(λ, U, |λ|, order, eps)``: the eigenvalues and eigenvectors of the symmetric
        ``M`` per sample, their magnitudes, the order of those from the largest, and the
        machine epsilon of ``M``'s dtype."""
        values, vectors = torch.linalg.eigh(M)
        magnitude = values.abs()
        order = torch.argsort(magnitude, dim=-1, descending=True)
        return values, vectors, magnitude, order, torch.finfo(M.dtype).eps

    def largest(self, a: Array) -> Array:
        """The largest entry along the last axis, that axis kept."""
        return a.max(-1, keepdims=True).values

    def take(self, a: Array, index: Array) -> Array:
        """``a``'s entries at ``index`` along the last axis."""
        return torch.take_along_dim(a, index, dim=-1)


#: The array calls of each backend.
ARRAYS: dict[str, NumpyArrays | TorchArrays] = {"numpy": NumpyArrays(), "torch": TorchArrays()}
