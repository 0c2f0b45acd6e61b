"""A call's namespace: the dict a module's group functions read their inputs from and store
their nodes in. Its inputs are checked, batched, widened and bound in the engine's shapes
(sizes bound by name beside them; ``_single``, ``_like``, ``_dtype`` say how the results go
back), its groups run once each, after those they require, and are released when no later
step reads them; results leave it in the caller's layout, checked for overflow."""

# -- stand-ins: the generated module defines these (not copied) --
from ._module_names import (
    _BATCHED,
    _CONSTANT_DIMS,
    _ENGINE_SHAPES,
    _GROUPS,
    _JOINT_DIRECTIONS,
    _LOSS_HESSIAN,
    _LOSS_HESSIAN_FULL,
    _WRITES,
    CONSTANTS,
    INPUT_SHAPE,
    LOSS,
    OUTPUT_SHAPE,
    PARAMS,
    SCOPE,
    TARGET_SHAPE,
)
from .arguments import _bind_dims, _checked, _dim, _require_finite, _split_direction

# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import (
    _any_true,
    _as_array,
    _as_labels,
    _first_true,
    _machine_eps,
    _one_hot,
    _widened,
    _zeros,
)

# -- end stand-ins --


def _parameter_names():
    """The names of the parameters, in order (list of str)."""
    return [name for name, _ in PARAMS]


def _prepare(params, X, target=None):
    """The namespace of one call: inputs checked, batched and widened, sizes bound (dict)."""
    X = _as_array(X, "X")
    like, X = X, _widened(X)
    if X.ndim not in (len(INPUT_SHAPE), len(INPUT_SHAPE) + 1):
        raise ValueError(f"X: expected shape (B, {', '.join(INPUT_SHAPE)}) or "
                         f"({', '.join(INPUT_SHAPE)}), got shape {tuple(X.shape)}")
    single = X.ndim == len(INPUT_SHAPE)
    if single:
        X = X[None]
    if 0 in tuple(X.shape):
        raise ValueError(f"X: expected at least one sample of nonzero sizes "
                         f"(B, {', '.join(INPUT_SHAPE)}), got shape {tuple(X.shape)}")
    dims = {"B": X.shape[0], **_CONSTANT_DIMS}
    _bind_dims(X[0], INPUT_SHAPE, "X", dims)
    X = X.reshape((dims["B"],) + _engine_dims("X", dims))
    if "h" in dims and "d_v" not in dims:
        if dims["d"] % dims["h"]:
            raise ValueError(f"X: expected a width d divisible by the number of heads "
                             f"h = {dims['h']}, got d = {dims['d']}")
        dims["d_v"] = dims["d"] // dims["h"]
    _require_finite(X, "X")
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of name -> array, got {type(params).__name__}")
    expected = [name for name, _ in PARAMS + CONSTANTS]
    unknown = sorted(set(params) - set(expected))
    missing = [name for name in expected if name not in params]
    if unknown or missing:
        raise ValueError(f"params: expected exactly the keys {expected}, got unknown {unknown} "
                         f"and missing {missing}")
    ns = {"X": X, "_single": single, "_done": set(), "_like": like, "_dtype": like.dtype}
    _bind_params(ns, params, dims, like)
    ns.update(dims)
    if target is not None:
        _bind_target(ns, target)
    return ns


def _bind_params(ns, params, dims, like):
    """Check the parameters and constants of ``params``; bind them in ``ns``, sizes in ``dims``."""
    rotary = "n_2" in _CONSTANT_DIMS or "n_r" in _CONSTANT_DIMS
    for name, shape in PARAMS:
        argument = f"params[{name!r}]"
        value = _as_array(params[name], argument, like=like)
        _bind_dims(value, shape, argument, dims)
        if rotary and "d_k" in dims and "d_r" not in dims:
            chunks = dims.get("n_r", 2)
            if dims["d_k"] % chunks:
                raise ValueError(f"{argument}: expected a head width d_k divisible by "
                                 f"{chunks} (rotary embeddings turn pairs of the first two of "
                                 f"{chunks} equal chunks), got d_k = {dims['d_k']}")
            dims["d_r"] = dims["d_k"] // chunks
        _require_finite(value, argument)
        ns[name] = _widened(value).reshape(_engine_dims(name, dims))
    for name, shape in CONSTANTS:
        argument = f"params[{name!r}]"
        value = _as_array(params[name], argument, like=like)
        batch = ("B",) if name in _BATCHED else ()
        _bind_dims(value, batch + shape, argument, dims)
        if bool((value != value).any()):  # -inf is allowed (a mask), NaN is not
            raise ValueError(f"{argument}: expected values that are not NaN, got NaN")
        ns[name] = _widened(value).reshape(tuple(dims[b] for b in batch)
                                            + _engine_dims(name, dims))


def _bind_target(ns, target):
    """Check ``target`` and bind it in ``ns`` as ``T`` (engine shape, batched)."""
    like, single = ns["_like"], ns["_single"]
    if LOSS == "cross_entropy":
        # class indices, one per row of the output; the classes are its last axis
        target = _as_labels(target, "target")
        if single:
            target = target[None]
        rows = tuple(_dim(n, ns) for n in TARGET_SHAPE)
        classes = _dim(OUTPUT_SHAPE[-1], ns)
        if tuple(target.shape) != (ns["B"],) + rows:
            got = tuple(target.shape[1:] if single else target.shape)
            batch = "" if single else "B, "
            raise ValueError(f"target: expected class indices of shape "
                             f"({batch}{', '.join(TARGET_SHAPE)}) = "
                             f"{rows if single else (ns['B'],) + rows}, got shape {got}")
        counted = target != -100  # torch's ignore_index: the row adds nothing
        labels = target * counted
        outside = (labels < 0) | (labels >= classes)
        if bool(outside.any()):
            at = tuple(int(i) for i in _first_true(outside))
            raise ValueError(f"target: expected class indices in [0, {OUTPUT_SHAPE[-1]}) = "
                             f"[0, {classes}) or -100 (ignored), got {int(target[at])} at "
                             f"index {at[1:] if single else at}")
        T = _one_hot(labels, classes, ns["X"], counted)
        ns["T"] = T.reshape((ns["B"],) + _engine_dims("Z", ns))
    else:
        target = _widened(_as_array(target, "target", like=like))
        if single:
            target = target[None]
        rows = tuple(_dim(n, ns) for n in TARGET_SHAPE)
        if tuple(target.shape) != (ns["B"],) + rows:
            got = tuple(target.shape[1:] if single else target.shape)
            batch = "" if single else "B, "
            raise ValueError(f"target: expected shape ({batch}{', '.join(TARGET_SHAPE)}) = "
                             f"{rows if single else (ns['B'],) + rows}"
                             f", got shape {got}")
        _require_finite(target, "target")
        ns["T"] = target.reshape((ns["B"],) + _engine_dims("Z", ns))


def _guard(ns, value, scale, argument, message):
    """Raise unless every entry of ``value`` is positive relative to ``scale``."""
    bad = value <= 256 * _machine_eps(value) ** 2 * (scale ** 2 + value)
    if _any_true(bad):
        sample, row = (int(k) for k in _first_true(bad))
        where = "" if ns["_single"] else f"sample {sample}, "
        raise ValueError(f"{argument}: {message} ({where}row {row}).")


def _run(ns, group):
    """Compute ``group`` into ``ns`` after the groups it requires (once per call)."""
    if group in ns["_done"]:
        return
    if group not in _GROUPS:
        raise NotImplementedError(
            f"{group}: not derived in this module, generated with scope {SCOPE!r} "
            "(\"products\": loss, gradient, Hessian- and Gauss-Newton-vector products; "
            "\"blocks\": also Jacobians, loss-Hessian blocks, diagonals, Kronecker factors; "
            "\"all\": also output Hessians)")
    function, requires = _GROUPS[group]
    for required in requires:
        _run(ns, required)
    function(ns)
    ns["_done"].add(group)


def _release(ns, group):
    """Drop what ``group`` computed (no later step of the call reads it)."""
    if group in ns["_done"]:
        for name in _WRITES[group]:
            ns.pop(name, None)
        ns["_done"].discard(group)


def _loss_hessian_block(ns, key, part):
    """Block ``key`` of ``part``, shape ``(*shape(V), *shape(W))``, taken out of ``ns``."""
    # each block is used once: dropping it keeps peak memory near the output's size
    if part == "full":  # computed whole: the two parts share their products
        _run(ns, f"loss_hessian_full_{key[0]}_{key[1]}")
        return ns.pop(_LOSS_HESSIAN_FULL[key])
    _run(ns, f"loss_hessian_{key[0]}_{key[1]}")
    parts = {p: ns.pop(_LOSS_HESSIAN[key + (p,)]) for p in ("gauss_newton", "functional")}
    return parts[part]


_SHAPES = {"X": INPUT_SHAPE, "Z": OUTPUT_SHAPE, **dict(PARAMS), **dict(CONSTANTS)}


def _engine_dims(name, dims):
    """The engine's shape of ``name`` (X, Z, a parameter or a constant) in sizes (tuple)."""
    return tuple(_dim(s, dims) for s in _ENGINE_SHAPES.get(name, _SHAPES[name]))


def _output(ns, value):
    """The output ``value`` (engine shape) in the shape ``(B, *OUTPUT_SHAPE)``."""
    return value.reshape((ns["B"],) + tuple(_dim(s, ns) for s in OUTPUT_SHAPE))


def _numel(ns, shape):
    """The number of entries of a shape given by size names (int)."""
    size = 1
    for name in shape:
        size *= _dim(name, ns)
    return size


def _size(ns, variable):
    """``n_variable``, the number of entries of one ``variable`` (int)."""
    return _numel(ns, INPUT_SHAPE if variable == "X" else dict(PARAMS)[variable])


def _per_sample(ns, value):
    """``value`` without its batch axis when a single sample was passed."""
    return value[0] if ns["_single"] else value


def _result(ns, value, function, quantity):
    """``value`` in the dtype of the inputs; FloatingPointError where it is not finite."""
    inputs = {name: ns[name] for name in ["X", *_parameter_names()]}
    return _checked(value, ns["_dtype"], function, quantity, inputs)


def _input_is_data(v_X):
    """Whether ``X`` is data (token ids' one-hot rows: no direction); ValueError for a ``v_X``."""
    if "X" in _JOINT_DIRECTIONS:
        return False
    if v_X is not None:
        raise ValueError("v_X: expected None: X holds the one-hot rows of token ids here, "
                         "which are data, not a variable")
    return True


def _input_direction(ns, v, argument, slot):
    """Check ``v``, a direction in the input (``vec_r`` per sample); bind it to ``slot``."""
    n = _size(ns, "X")
    v = _as_array(v, argument, like=ns["_like"])
    expected = (n,) if ns["_single"] else (ns["B"], n)
    if tuple(v.shape) != expected:
        raise ValueError(f"{argument}: expected shape {expected} (the input's vec_r per "
                         f"sample), got shape {tuple(v.shape)}")
    _require_finite(v, argument)
    ns[slot] = _widened(v).reshape((ns["B"],) + _engine_dims("X", ns))


def _parameter_directions(ns, v, names, slots):
    """Check ``v`` (the ``names`` blocks concatenated; None: 0); bind each to ``slots``."""
    sizes = {name: _size(ns, name) for name, _ in PARAMS}
    views = {} if v is None else _split_direction(v, names, sizes, ns["_like"])
    for name, _ in PARAMS:
        dims = _engine_dims(name, ns)
        ns[slots[name]] = views[name].reshape(dims) if name in views else _zeros(ns, dims)
