"""The array primitives of a torch module: type and dtype checks of its inputs, widening,
elementwise functions without overflow, zeros, matrix products into the caller's arrays,
row-major einsums in slices (the numpy module has the same names, ``numpy_arrays.py``)."""

# -- stand-ins: the generated module defines these (not copied) --
import math

import torch

# -- end stand-ins --

def _as_array(value, argument, like=None):
    """``value`` as a float tensor like ``like`` (dtype, device); TypeError naming ``argument``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument}: expected a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{argument}: expected a floating-point tensor, got dtype {value.dtype}")
    if value.device.type == "meta":
        raise ValueError(f"{argument}: expected a tensor with values, got one on the meta "
                         "device (shapes only)")
    if like is not None and (value.dtype != like.dtype or value.device != like.device):
        raise TypeError(f"{argument}: expected dtype {like.dtype} on {like.device} "
                        f"(those of X), got {value.dtype} on {value.device}")
    return value


def _all_finite(tensor):
    """Whether every entry of ``tensor`` is finite (bool)."""
    # the sum is finite when every entry is (one reduction, ten times cheaper than
    # isfinite().all() on small tensors); only an overflowing sum needs the full check
    return math.isfinite(float(tensor.detach().sum())) or bool(torch.isfinite(tensor).all())


def _widened(tensor):
    """``tensor`` in the dtype it is computed in: float16 and bfloat16 in float32."""
    # their 11- and 8-bit significands fail the cancellations and products of second
    # derivatives; results come back in the input dtype
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _cast(value, dtype):
    """``value`` in ``dtype`` (tensor)."""
    return value.to(dtype)


def _dtype_name(value):
    """The dtype of ``value`` as text, e.g. ``float64``."""
    return str(value.dtype).removeprefix("torch.")


def _magnitude(tensor):
    """The largest ``|entry|`` of ``tensor`` (float; 0 when empty)."""
    return float(tensor.detach().abs().max()) if tensor.numel() else 0.0


def _machine_eps(tensor):
    """The machine epsilon of the dtype of ``tensor`` (float)."""
    return float(torch.finfo(tensor.dtype).eps)


def _sech(tensor):
    """1/cosh, without overflow: 2 e^-|u| / (1 + e^-2|u|)."""
    small = torch.exp(-tensor.abs())
    return 2 * small / (1 + small * small)


def _sigmoid(tensor):
    """1 / (1 + e^-u), entry by entry (torch's own is overflow-free)."""
    return torch.sigmoid(tensor)


def _softplus(tensor):
    """log(1 + e^u), without overflow: max(u, 0) + log(1 + e^-|u|)."""
    return tensor.clamp(min=0) + torch.log1p(torch.exp(-tensor.abs()))


def _any_true(mask):
    """Whether ``mask`` has a true entry (bool; under torch.compile an assertion, and False)."""
    # compiled, a failed assertion raises RuntimeError, and curvgap's fused runner reruns the
    # group uncompiled, which raises the worded error
    if torch.compiler.is_compiling():
        torch._assert_async(~mask.any(), "curvgap: a guard of the generated code failed")
        return False
    return bool(mask.any())


def _first_true(mask):
    """The index of the first true entry of ``mask`` (list of ints)."""
    return torch.nonzero(mask)[0].tolist()


def _as_labels(value, argument):
    """``value`` as an integer tensor of class indices; TypeError naming ``argument``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument}: expected a torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{argument}: expected integer class indices, got dtype {value.dtype}")
    if value.device.type == "meta":
        raise ValueError(f"{argument}: expected class indices with values, got a tensor on "
                         "the meta device (shapes only)")
    return value


def _row_selector(ns, start, stop, rows):
    """A selector ``(rows, stop − start)``: entry ``[start + r, r]`` is 1, the rest 0."""
    X = ns["X"]
    labels = torch.arange(start, stop, device=X.device)
    return torch.nn.functional.one_hot(labels, rows).to(X.dtype).T.contiguous()


def _one_hot(labels, classes, like, weights=None):
    """``labels`` ``(B, L)`` as one-hot rows ``(B, L, classes)`` of ``weights`` (None: 1)."""
    labels = labels.long()
    out = torch.zeros(labels.shape + (classes,), dtype=like.dtype, device=like.device)
    ones = (torch.ones(labels.shape, dtype=like.dtype, device=like.device) if weights is None
            else weights.to(like.dtype))
    return out.scatter_(-1, labels[..., None], ones[..., None])


def _zeros(ns, shape):
    """Zeros of ``shape`` in the dtype and on the device of ``X``."""
    return torch.zeros(shape, dtype=ns["X"].dtype, device=ns["X"].device)


def _matmul_into(ns, name, a, b):
    """``a @ b``, into the caller's array for the result ``name`` if ``ns["_out"]`` has one."""
    out = ns.get("_out")
    array = None if out is None else out.get(name)
    if array is None:
        return a @ b
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    return torch.matmul(a, b, out=array.view(shape))


def _token_rows(ns):
    """``(ids, kept)``, each ``(B, ...)``: the token ids of ``X``'s one-hot rows, read once."""
    # kept is 1 where a row holds its one, 0 for a row of zeros (a padding id, read as id 0)
    if "_ids" not in ns:
        ns["_kept"], ns["_ids"] = ns["X"].max(dim=-1)
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
        count = 1
        for size in ids.shape[:lead]:
            count *= size
        offsets = torch.arange(count, device=ids.device) * rows
        index = ids + offsets.reshape(tuple(ids.shape[:lead]) + (1,) * (ids.ndim - lead))
    shape = tuple(ids.shape[:lead]) + (rows,) + rest
    out = ns.get("_out")
    array = None if out is None or name is None else out.get(name)
    result = (torch.zeros(shape, dtype=values.dtype, device=values.device) if array is None
              else array.view(shape).zero_())
    weighted = values * kept.reshape(kept.shape + (1,) * len(rest))
    result.view((-1,) + rest).index_add_(0, index.reshape(-1), weighted.reshape((-1,) + rest))
    return result


def _contiguous_size(array):
    """The number of entries of ``array`` when it is contiguous (row-major), else None."""
    return array.numel() if array.is_contiguous() else None


def _into(array, value):
    """A view of ``array`` (contiguous) shaped as ``value``, holding it (copied unless there)."""
    view = array.view(value.shape)
    if view.data_ptr() != value.data_ptr() or view.stride() != value.stride():
        view.copy_(value)
    return view


def _causal_bias(ns, size):
    """0 where a query may attend (key index <= query index), -inf elsewhere."""
    X = ns["X"]
    return torch.triu(torch.full((size, size), float("-inf"), dtype=X.dtype, device=X.device), 1)


def _floats(values, like):
    """The Python floats ``values`` (nested lists) in the dtype and on the device of ``like``."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _indices(values, like):
    """The Python ints ``values`` (nested lists) as an integer tensor on the device of ``like``."""
    return torch.tensor(values, device=like.device)


def _cos(tensor):
    """cos, entry by entry."""
    return torch.cos(tensor)


def _sin(tensor):
    """sin, entry by entry."""
    return torch.sin(tensor)


def _placed(result, rows, columns, block):
    """``result`` with ``block`` written into its ``rows`` and ``columns`` (in place)."""
    result[rows, columns] = block
    return result


def _stack_columns(tensors):
    """The 1-D ``tensors`` as the columns of a matrix, shape ``(size, len(tensors))``."""
    return torch.stack(tensors, dim=1)


def _concatenate(tensors):
    """The 1-D ``tensors`` one after another, shape ``(sum of sizes,)``."""
    return torch.cat(tensors)


def _tied(tensor, spec):
    """A writeable view of the entries of ``tensor`` whose tied indices are equal ("bijj->bij")."""
    # no copy: the strides of tied axes add up
    source, view = spec.split("->")
    strides = dict.fromkeys(view, 0)
    sizes = {}
    for letter, size, stride in zip(source, tensor.shape, tensor.stride()):
        strides[letter] += stride
        sizes[letter] = size
    return tensor.as_strided([sizes[c] for c in view], [strides[c] for c in view],
                             tensor.storage_offset())


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
        return torch.einsum(spec, x, y).contiguous()
    result = torch.empty(shape, dtype=x.dtype, device=x.device)
    step = -(-shape[0] // 16)
    axes = [letters.find(out[0]) for letters in inputs.split(",")]
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])
        pieces = [operand if axis < 0 else operand.narrow(axis, start, stop - start)
                  for operand, axis in zip((x, y), axes)]
        result[start:stop] = torch.einsum(spec, *pieces)
    return result
