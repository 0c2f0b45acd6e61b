"""Checking arguments, as pure functions of what they are given (no module data read): sizes
bound from shapes given in dimension names, finite values, the names of ``wrt`` and
``part``, a direction ``v`` over several parameters split into theirs, the caller's arrays
for ``out=``, and a result checked for overflow and returned in the inputs' dtype."""

# -- stand-ins: the generated module defines these (not copied) --
# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import (
    _all_finite,
    _as_array,
    _cast,
    _contiguous_size,
    _dtype_name,
    _magnitude,
    _widened,
)

# -- end stand-ins --


def _dim(name, dims):
    """The size of a dimension name such as ``d`` or ``h*d_k`` (None while unknown)."""
    size = 1
    for factor in name.split("*"):
        if factor not in dims:
            return None
        size *= dims[factor]
    return size


def _shape_text(names, dims):
    """The expected shape as names and as sizes, ``(L, d) = (3, 6)`` (text)."""
    def tuple_text(items):
        """``items`` as a Python tuple is written (text)."""
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    known = [str(_dim(n, dims)) if _dim(n, dims) is not None else n for n in names]
    return tuple_text(names) + " = " + tuple_text(known)


def _bind_dims(value, names, argument, dims):
    """Bind the sizes the shape names of ``value`` imply into ``dims``; ValueError on a mismatch."""
    shape = tuple(value.shape)
    if len(shape) != len(names):
        raise ValueError(f"{argument}: expected shape {_shape_text(names, dims)}, "
                         f"got shape {shape}")
    for name, size in zip(names, shape):
        unknown = [f for f in name.split("*") if f not in dims]
        if len(unknown) == 1:
            rest = _dim(name.replace(unknown[0], "1"), {**dims, "1": 1})
            if size % rest == 0:
                dims[unknown[0]] = size // rest
        if _dim(name, dims) != size:
            raise ValueError(f"{argument}: expected shape {_shape_text(names, dims)} to match "
                             f"the other inputs, got shape {shape}")


def _require_finite(value, argument):
    """ValueError on ``argument`` unless every entry of ``value`` is finite."""
    if not _all_finite(value):
        raise ValueError(f"{argument}: expected finite values, got NaN or inf")


def _a(value):
    """What ``value`` is, as text: ``a list``, ``an int``."""
    kind = type(value).__name__
    return ("an " if kind[:1].lower() in "aeiou" else "a ") + kind


def _named(names, most=8):
    """``names`` as a list to quote in a message: the first ``most`` of a long one (text)."""
    names = list(names)
    if len(names) <= most:
        return str(names)
    return str(names[:most])[:-1] + f", ... ({len(names)} in all)]"


def _check_variable(wrt, argument, names, input_varies=True):
    """``wrt`` if it is ``X`` (where ``input_varies``) or one of ``names``, else ValueError."""
    if isinstance(wrt, str) and wrt == "X" and not input_varies:
        raise ValueError(f"{argument}: expected one of the parameters {_named(names)}, got "
                         f"'X', which holds the one-hot rows of token ids here: data, not a "
                         f"variable (autograd takes no derivative in integer ids either); "
                         f"pass the embedded rows instead (inputs_embeds=... for a Hugging "
                         f"Face model) for derivatives in the input")
    if not isinstance(wrt, str) or (wrt != "X" and wrt not in names):
        got, by = (repr(wrt), "") if isinstance(wrt, str) else (_a(wrt), " by name")
        expected = "'X' or one of the parameters" if input_varies else "one of the parameters"
        raise ValueError(f"{argument}: expected {expected} {_named(names)}{by}, got {got}")
    return wrt


def _check_wrt(wrt, names, input_varies=True):
    """The variables of ``wrt`` (default: the parameter ``names``, or X), checked (list of str)."""
    if wrt is None:
        return list(names) or [_check_variable("X", "wrt", names, input_varies)]
    if not isinstance(wrt, (str, list, tuple)):
        raise TypeError(f"wrt: expected 'X', a parameter name or a list of names, got "
                        f"{_a(wrt)}")
    chosen = [wrt] if isinstance(wrt, str) else list(wrt)
    if not chosen:
        raise ValueError("wrt: expected 'X' or a non-empty list of parameter names, got []")
    for name in chosen:
        _check_variable(name, "wrt", names, input_varies)
    if "X" in chosen and len(chosen) > 1:
        raise ValueError(f"wrt: expected 'X' alone or parameter names only, got {chosen}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"wrt: expected distinct names, got {chosen}")
    return chosen


def _check_part(part):
    """``part`` if it is a loss-Hessian part, else ValueError (str)."""
    if part not in ("full", "gauss_newton", "functional"):
        raise ValueError(f"part: expected 'full', 'gauss_newton' or 'functional', got {part!r}")
    return part


def _split_direction(v, names, sizes, like):
    """``v`` (the ``names`` blocks concatenated, in that order), checked: name → flat view."""
    # ``sizes``: each parameter's number of entries; the views widened (float16 in float32)
    v = _as_array(v, "v", like=like)
    total = sum(sizes[name] for name in names)
    if tuple(v.shape) != (total,):
        raise ValueError(f"v: expected shape ({total},) (the vec_r of {_named(names)} "
                         f"concatenated), got shape {tuple(v.shape)}")
    _require_finite(v, "v")
    v = _widened(v)
    views, offset = {}, 0
    for name in names:
        views[name] = v[offset:offset + sizes[name]]
        offset += sizes[name]
    return views


def _split_directions(v, names, sizes, like):
    """``v`` ``(n,)`` or ``(n, k)`` (directions as columns), split: one dict per direction."""
    # each column as :func:`_split_direction` splits one
    total = sum(sizes[name] for name in names)
    if getattr(v, "ndim", 1) == 2 and tuple(v.shape)[:1] == (total,) and v.shape[1] >= 1:
        return [_split_direction(v[:, k], names, sizes, like) for k in range(v.shape[1])]
    if getattr(v, "ndim", 1) != 1:
        raise ValueError(f"v: expected shape ({total},) or ({total}, k), k >= 1 (the vec_r "
                         f"of {_named(names)} concatenated; k directions as columns), got shape "
                         f"{tuple(getattr(v, 'shape', ()))}")
    return [_split_direction(v, names, sizes, like)]


def _check_slots(out, sizes, like):
    """ValueError unless ``out`` maps parameters to contiguous arrays of their sizes."""
    # ``sizes``: every parameter → its number of entries; the arrays in the dtype (and on the
    # device) of ``like``
    for name, array in out.items():
        if name not in sizes:
            raise ValueError(f"out: expected arrays for the parameters {list(sizes)}, got one "
                             f"for {name!r}")
        argument = f"out[{name!r}]"
        _as_array(array, argument, like=like)
        size = _contiguous_size(array)
        if size != sizes[name]:
            raise ValueError(f"{argument}: expected a contiguous array of {sizes[name]} "
                             f"entries (the size of {name}), got shape {tuple(array.shape)}"
                             + (", not contiguous" if size is None else ""))


def _trace_of(diagonal, function):
    """The trace from ``diagonal`` (summed over its last axis, wide), checked for overflow."""
    return _checked(_widened(diagonal).sum(-1), diagonal.dtype, function, "the trace",
                    {"diagonal": diagonal})


def _largest(inputs):
    """The largest ``|entry|`` of each of ``inputs`` (name → array), as text."""
    return ", ".join(f"{name} {_magnitude(value):.3g}" for name, value in inputs.items())


def _checked(value, dtype, function, quantity, inputs):
    """``value`` in ``dtype`` (the inputs'); FloatingPointError where it is not finite."""
    # every input (``inputs``: name → array, for the message) was checked finite: a
    # non-finite result means the arithmetic overflowed
    computed = _dtype_name(value)
    if not _all_finite(value):
        raise FloatingPointError(
            f"{function}: {quantity} has entries that are inf or NaN although every input is "
            f"finite: the arithmetic overflowed {computed} (largest |entry|: "
            f"{_largest(inputs)}); "
            + ("pass float64 inputs, or " if computed != "float64" else "pass ")
            + "inputs and parameters of smaller magnitude")
    if value.dtype == dtype:
        return value
    out = _cast(value, dtype)
    if not _all_finite(out):
        raise FloatingPointError(
            f"{function}: {quantity} was computed in {computed} but exceeds the range of "
            f"{_dtype_name(out)} (largest |entry| {_magnitude(value):.3g}); pass float32 or "
            "float64 inputs")
    return out
