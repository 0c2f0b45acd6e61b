"""The array primitives of a numpy module: type and dtype checks of its inputs, widening,
elementwise functions without overflow, zeros, matrix products into the caller's arrays,
row-major einsums in slices (the torch module has the same names, ``torch_arrays.py``)."""

# -- stand-ins: the generated module defines these (not copied) --
import math

import numpy as np

# -- end stand-ins --

def _as_array(value, argument, like=None):
    """``value`` as a float array in the dtype of ``like``; TypeError naming ``argument``."""
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise TypeError(f"{argument}: expected a floating-point array, got dtype {array.dtype}")
    if like is not None and array.dtype != like.dtype:
        raise TypeError(f"{argument}: expected dtype {like.dtype} (the dtype of X), "
                        f"got {array.dtype}")
    return array


def _all_finite(array):
    """Whether every entry of ``array`` is finite (bool)."""
    # the sum is finite when every entry is (one pass, no boolean array); only a sum that
    # overflows needs the full check
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.sum(array)
    return bool(np.isfinite(total)) or bool(np.isfinite(array).all())


def _widened(array):
    """``array`` in the dtype it is computed in: float16 in float32, others as they are."""
    # float16's 11-bit significand and 65504 range fail the cancellations and products of
    # second derivatives; results come back in float16
    return array.astype(np.float32) if array.dtype == np.float16 else array


def _cast(value, dtype):
    """``value`` in ``dtype`` (array or scalar)."""
    return np.asarray(value).astype(dtype, copy=False)[()]


def _dtype_name(value):
    """The dtype of ``value`` as text, e.g. ``float64``."""
    return str(np.asarray(value).dtype)


def _magnitude(array):
    """The largest ``|entry|`` of ``array`` (float; 0 when empty)."""
    return float(np.abs(np.asarray(array, dtype=np.float64)).max(initial=0.0))


def _machine_eps(array):
    """The machine epsilon of the dtype of ``array`` (float)."""
    return float(np.finfo(array.dtype).eps)


def _any_true(mask):
    """Whether ``mask`` has a true entry (bool)."""
    return bool(mask.any())


def _first_true(mask):
    """The index of the first true entry of ``mask`` (array of ints)."""
    return np.argwhere(mask)[0]


def _as_labels(value, argument):
    """``value`` as an integer array of class indices; TypeError naming ``argument``."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{argument}: expected integer class indices, got dtype {array.dtype}")
    return array


def _row_selector(ns, start, stop, rows):
    """A selector ``(rows, stop − start)``: entry ``[start + r, r]`` is 1, the rest 0."""
    return (np.arange(rows)[:, None] == np.arange(start, stop)).astype(ns["X"].dtype)


def _one_hot(labels, classes, like, weights=None):
    """``labels`` ``(B, L)`` as one-hot rows ``(B, L, classes)`` of ``weights`` (None: 1)."""
    out = np.zeros(labels.shape + (classes,), dtype=like.dtype)
    ones = 1 if weights is None else weights[..., None]
    np.put_along_axis(out, labels[..., None].astype(np.int64), ones, axis=-1)
    return out


def _erf(array):
    """The error function, entry by entry (numpy has none; math.erf is exact to rounding)."""
    return np.vectorize(math.erf, otypes=[array.dtype])(array)


def _sech(array):
    """1/cosh, without overflow: 2 e^-|u| / (1 + e^-2|u|)."""
    small = np.exp(-np.abs(array))
    return 2 * small / (1 + small * small)


def _sigmoid(array):
    """1 / (1 + e^-u), without overflow: e^-|u| is at most 1."""
    small = np.exp(-np.abs(array))
    return np.where(array >= 0, 1 / (1 + small), small / (1 + small))


def _softplus(array):
    """log(1 + e^u), without overflow: max(u, 0) + log(1 + e^-|u|)."""
    return np.maximum(array, 0) + np.log1p(np.exp(-np.abs(array)))


def _zeros(ns, shape):
    """Zeros of ``shape`` in the dtype of ``X``."""
    return np.zeros(shape, dtype=ns["X"].dtype)


def _matmul_into(ns, name, a, b):
    """``a @ b``, into the caller's array for the result ``name`` if ``ns["_out"]`` has one."""
    out = ns.get("_out")
    array = None if out is None else out.get(name)
    if array is None:
        return a @ b
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    return np.matmul(a, b, out=array.reshape(shape))


def _token_rows(ns):
    """``(ids, kept)``, each ``(B, ...)``: the token ids of ``X``'s one-hot rows, read once."""
    # kept is 1 where a row holds its one, 0 for a row of zeros (a padding id, read as id 0)
    if "_ids" not in ns:
        ns["_ids"], ns["_kept"] = ns["X"].argmax(axis=-1), ns["X"].max(axis=-1)
    return ns["_ids"], ns["_kept"]


def _gather_rows(ns, table):
    """``X @ table`` (``(B, ..., V)`` one-hot, ``(V, N...)``): the rows at the ids, gathered."""
    ids, kept = _token_rows(ns)
    return table[ids] * kept.reshape(kept.shape + (1,) * (table.ndim - 1))


def _scatter_rows(ns, values, lead, name=None):
    """``Xᵀ values`` over all but ``lead`` row axes, ``(*lead, V, N...)``, by scatter-adds."""
    # each row of values (B, ..., N...) is added into its id's row; written into the
    # caller's array for the result ``name`` if ns["_out"] has one
    ids, kept = _token_rows(ns)
    rest = tuple(values.shape[ids.ndim:])
    rows = ns["X"].shape[-1]
    index = ids
    if lead:  # one table per leading position: its ids offset past the others' tables
        count = int(np.prod(ids.shape[:lead]))
        offsets = np.arange(count) * rows
        index = ids + offsets.reshape(tuple(ids.shape[:lead]) + (1,) * (ids.ndim - lead))
    shape = tuple(ids.shape[:lead]) + (rows,) + rest
    out = ns.get("_out")
    array = None if out is None or name is None else out.get(name)
    result = np.zeros(shape, dtype=values.dtype) if array is None else array.reshape(shape)
    if array is not None:
        result[...] = 0
    weighted = values * kept.reshape(kept.shape + (1,) * len(rest))
    np.add.at(result.reshape((-1,) + rest), index.reshape(-1), weighted.reshape((-1,) + rest))
    return result


def _contiguous_size(array):
    """The number of entries of ``array`` when it is contiguous (row-major), else None."""
    return array.size if array.flags.c_contiguous else None


def _into(array, value):
    """A view of ``array`` (contiguous) shaped as ``value``, holding it (copied unless there)."""
    view = array.reshape(value.shape)
    if view.ctypes.data != value.ctypes.data or view.strides != value.strides:
        view[...] = value
    return view


def _causal_bias(ns, size):
    """0 where a query may attend (key index <= query index), -inf elsewhere."""
    return np.triu(np.full((size, size), -np.inf, dtype=ns["X"].dtype), 1)


def _floats(values, like):
    """The Python floats ``values`` (nested lists) in the dtype of ``like``."""
    return np.asarray(values, dtype=like.dtype)


def _indices(values, like):
    """The Python ints ``values`` (nested lists) as an integer array (``like``: as for torch)."""
    return np.array(values)


def _cos(array):
    """cos, entry by entry."""
    return np.cos(array)


def _sin(array):
    """sin, entry by entry."""
    return np.sin(array)


def _placed(result, rows, columns, block):
    """``result`` with ``block`` written into its ``rows`` and ``columns`` (in place)."""
    result[rows, columns] = block
    return result


def _stack_columns(arrays):
    """The 1-D ``arrays`` as the columns of a matrix, shape ``(size, len(arrays))``."""
    return np.stack(arrays, axis=1)


def _concatenate(arrays):
    """The 1-D ``arrays`` one after another, shape ``(sum of sizes,)``."""
    return np.concatenate(arrays)


#: Results of a row-major einsum with more entries than this are made in slices.
_SLICED = 2**22


def _row_major_einsum(spec, x, y):
    """``einsum(spec, x, y)`` laid out row-major; a large one in slices of its first axis."""
    # a permuted einsum result made contiguous would be held twice; slices keep one copy
    inputs, out = spec.split("->")
    sizes = {}
    for letters, operand in zip(inputs.split(","), (x, y)):
        sizes.update(zip(letters, operand.shape))
    shape = [sizes[c] for c in out]
    total = 1
    for size in shape:
        total *= size
    if total <= _SLICED or shape[0] < 2:
        return np.ascontiguousarray(np.einsum(spec, x, y, optimize=True))
    result = np.empty(shape, dtype=np.result_type(x, y))
    step = -(-shape[0] // 16)
    axes = [letters.find(out[0]) for letters in inputs.split(",")]
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])
        pieces = [operand if axis < 0 else operand[(slice(None),) * axis + (slice(start, stop),)]
                  for operand, axis in zip((x, y), axes)]
        result[start:stop] = np.einsum(spec, *pieces, optimize=True)
    return result
