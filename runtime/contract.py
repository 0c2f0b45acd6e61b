"""The public API of a generated module over its groups: each function checks its arguments,
binds them in a call's namespace (``namespace.py``), runs the groups that compute what it
returns and gives the result in the caller's layout and dtype, checked for overflow."""

# -- stand-ins: the generated module defines these (not copied) --
from ._module_names import (
    _DIAGONAL,
    _DIAGONAL_ROWS,
    _DIRECTIONS,
    _GNVP,
    _GRADIENT,
    _HVP,
    _JACOBIAN,
    _JOINT_DIRECTIONS,
    _JOINT_GNVP,
    _JOINT_GRADIENT_NODE,
    _JOINT_HVP,
    _JVP_NODE,
    _KRONECKER,
    _LOSS_NODE,
    _OUTPUT_HESSIAN,
    _OUTPUT_NAME,
    _ROW_DIRECTIONS,
    _ROW_TANGENTS,
    OUTPUT_SHAPE,
    PARAMS,
    SCOPE,
    STRUCTURED,
)
from .arguments import _check_part, _check_variable, _check_wrt, _require_finite, _trace_of
from .namespace import (
    _engine_dims,
    _input_direction,
    _input_is_data,
    _loss_hessian_block,
    _numel,
    _output,
    _parameter_directions,
    _parameter_names,
    _per_sample,
    _prepare,
    _release,
    _result,
    _run,
    _size,
)

# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import (
    _as_array,
    _concatenate,
    _placed,
    _row_selector,
    _stack_columns,
    _widened,
    _zeros,
)

# -- end stand-ins --


def forward(params, X):
    """The output ``Z``, shape ``(B, *OUTPUT_SHAPE)``."""
    ns = _prepare(params, X)
    _run(ns, "forward")
    return _result(ns, _per_sample(ns, _output(ns, ns[_OUTPUT_NAME])), "forward", "the output")


def loss(params, X, target):
    """The loss (``LOSS``) of each sample, averaged over the batch (a scalar)."""
    ns = _prepare(params, X, target)
    _run(ns, "loss")
    return _result(ns, ns[_LOSS_NODE].mean(), "loss", "the loss")


def gradient(params, X, target, wrt=None):
    """The gradient of ``loss`` over ``wrt`` (default: all of ``PARAMS``, in order; a module
    without parameters defaults to ``"X"``), shape ``(n,)``, the ``wrt`` blocks of ``vec_r``
    concatenated. With ``wrt="X"``: per sample, the gradient of each sample's own loss in
    its own input, shape ``(B, L·d)``."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    ns = _prepare(params, X, target)
    _run(ns, "gradient")
    if names == ["X"]:
        value = ns[_GRADIENT["X"]].reshape(ns["B"], _size(ns, "X"))
        return _result(ns, _per_sample(ns, value), "gradient", "the gradient in X")
    return _result(ns, _concatenate([ns[_GRADIENT[name]].reshape(-1) for name in names]),
                   "gradient", f"the gradient in {names}")


def jacobian(params, X, wrt):
    """``∂vec_r(Z)/∂vec_r(wrt)^T`` per sample, shape ``(B, L·d, n_wrt)``."""
    ns = _prepare(params, X)
    variable = _check_variable(wrt, "wrt", _parameter_names(), "X" in _GRADIENT)
    _run(ns, "jacobian_" + variable)
    value = ns[_JACOBIAN[variable]]
    value = value.reshape(ns["B"], _numel(ns, OUTPUT_SHAPE), _size(ns, variable))
    return _result(ns, _per_sample(ns, value), "jacobian", f"the Jacobian in {variable}")


def output_hessian(params, X, wrt_i, wrt_j):
    """``∂²Z/∂wrt_i∂wrt_j`` per sample in the paper's layout, shape
    ``(B, L·d·n_i, n_j)``: entry ``[r·n_i + c, e]`` is
    ``∂²vec_r(Z)_r / ∂vec_r(wrt_i)_c ∂vec_r(wrt_j)_e``."""
    ns = _prepare(params, X)
    first = _check_variable(wrt_i, "wrt_i", _parameter_names(), "X" in _GRADIENT)
    second = _check_variable(wrt_j, "wrt_j", _parameter_names(), "X" in _GRADIENT)
    _run(ns, f"second_{first}_{second}")
    value = ns[_OUTPUT_HESSIAN[first, second]]
    value = value.reshape(ns["B"], -1, _size(ns, second))
    return _result(ns, _per_sample(ns, value), "output_hessian",
                   f"the second derivative in {first} and {second}")


def loss_hessian(params, X, target, wrt=None, part="full"):
    """The Hessian of ``loss`` over ``wrt`` (default: all of ``PARAMS``, in order; a module
    without parameters defaults to ``"X"``), shape ``(n, n)``, blocks in ``wrt`` order.
    ``part`` is ``"full"``, ``"gauss_newton"`` (``J^T ∂²ℓ/∂Z² J``) or ``"functional"``
    (``(∂ℓ/∂Z ⊗ I) ∂²Z``). With ``wrt="X"``: per sample, the Hessian of each sample's
    own loss in its own input, shape ``(B, L·d, L·d)``."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    part = _check_part(part)
    ns = _prepare(params, X, target)
    if names == ["X"]:
        n = _size(ns, "X")
        value = _loss_hessian_block(ns, ("X", "X"), part).reshape(ns["B"], n, n)
        return _result(ns, _per_sample(ns, value), "loss_hessian",
                       f"the {part} loss Hessian in X")
    if len(names) == 1:  # one block: returned as computed, not copied into a matrix
        n = _size(ns, names[0])
        value = _loss_hessian_block(ns, (names[0], names[0]), part).reshape(n, n)
        return _result(ns, value, "loss_hessian", f"the {part} loss Hessian in {names}")
    order = [name for name, _ in PARAMS]
    sizes = [_size(ns, name) for name in names]
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    result = _zeros(ns, (offsets[-1], offsets[-1]))
    for a, first in enumerate(names):
        for b in range(a, len(names)):
            second = names[b]
            swap = order.index(first) > order.index(second)
            key = (second, first) if swap else (first, second)
            block = _loss_hessian_block(ns, key, part)
            block = block.reshape(_size(ns, key[0]), _size(ns, key[1]))
            if swap:
                block = block.T
            rows, columns = slice(offsets[a], offsets[a + 1]), slice(offsets[b], offsets[b + 1])
            result = _placed(result, rows, columns, block)
            if a != b:
                result = _placed(result, columns, rows, block.T)
        # the later rows never read this variable's tangents again
        for group in (f"tangent_{first}", f"loss_tangent_{first}"):
            _release(ns, group)
    return _result(ns, result, "loss_hessian", f"the {part} loss Hessian in {names}")


def loss_hessian_mixed(params, X, target, wrt=None, part="full"):
    """Per sample, the block of each sample's own loss Hessian between its input and the
    parameters ``wrt`` (default: all of ``PARAMS``), shape ``(B, L·d, n)``: entry
    ``[b, r, c]`` is ``∂²ℓ_b / ∂vec_r(X_b)_r ∂θ_c``, ``θ`` the ``wrt`` blocks of ``vec_r``
    concatenated. ``part`` as for ``loss_hessian``."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    if "X" in names:
        raise ValueError(f"wrt: expected parameter names (the rows are X's), got {names}")
    if "X" not in _GRADIENT:
        raise ValueError("X: expected an input that is a variable (the rows are X's), got "
                         "the one-hot rows of token ids, which are data")
    part = _check_part(part)
    ns = _prepare(params, X, target)
    rows = ns["B"] * _size(ns, "X")
    sizes = [_size(ns, name) for name in names]
    offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    result = _zeros(ns, (rows, offsets[-1]))
    for k, name in enumerate(names):
        block = _loss_hessian_block(ns, ("X", name), part).reshape(rows, sizes[k])
        result = _placed(result, slice(None), slice(offsets[k], offsets[k + 1]), block)
        for group in (f"tangent_{name}", f"loss_tangent_{name}"):  # not read again
            _release(ns, group)
    value = result.reshape(ns["B"], _size(ns, "X"), offsets[-1])
    return _result(ns, _per_sample(ns, value), "loss_hessian_mixed",
                   f"the {part} loss Hessian in X and {names}")






def diagonal(params, X, target, wrt=None, part="full"):
    """The diagonal of ``loss_hessian(params, X, target, wrt, part)`` without forming the
    Hessian: shape ``(n,)`` (the ``wrt`` blocks of ``vec_r`` concatenated), or with
    ``wrt="X"`` per sample ``(B, L·d)``. Each block's diagonal is derived on its own."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    part = _check_part(part)
    ns = _prepare(params, X, target)
    parts = ("gauss_newton", "functional") if part == "full" else (part,)
    values = []
    for name in names:
        value = None
        for piece in parts:
            _run(ns, f"diagonal_{piece}_{name}")
            block = ns.pop(_DIAGONAL[name, piece])
            value = block if value is None else value + block
        values.append(value)
        for group in (f"tangent_{name}", f"loss_tangent_{name}"):  # not read again
            _release(ns, group)
    if names == ["X"]:
        value = values[0].reshape(ns["B"], _size(ns, "X"))
        return _result(ns, _per_sample(ns, value), "diagonal",
                       f"the diagonal of the {part} loss Hessian in X")
    return _result(ns, _concatenate([value.reshape(-1) for value in values]), "diagonal",
                   f"the diagonal of the {part} loss Hessian in {names}")


def hessian_trace(params, X, target, wrt=None, part="full"):
    """The trace of ``loss_hessian(params, X, target, wrt, part)``, a scalar, summed from its
    exact ``diagonal`` (the Hessian never formed); with ``wrt="X"`` per sample, ``(B,)``."""
    return _trace_of(diagonal(params, X, target, wrt, part), "hessian_trace")


def _row_parameter(wrt):
    """``wrt`` if it names a parameter with a diagonal on rows, else ValueError (str)."""
    if wrt not in _ROW_DIRECTIONS:
        raise ValueError(f"wrt: expected one of the parameters {list(_ROW_DIRECTIONS)} (this "
                         f"module's scope is {SCOPE!r}), got {wrt!r}")
    return wrt


def diagonal_row_layout(params, X, wrt):
    """How ``diagonal_rows`` divides the parameter ``wrt``: ``(rows, per_row, held)``, the
    length of its first axis (as the engine shapes it), the entries of one row (of its
    ``vec_r``, row after row) and the entries the tangents of one row hold over the batch of
    ``X`` (``R`` rows at once hold ``R`` times as many)."""
    name = _row_parameter(wrt)
    ns = _prepare(params, X)
    dims = _engine_dims(name, ns)
    per_row = 1
    for size in dims[1:]:
        per_row *= size
    held = sum(_numel(ns, shape) for shape in _ROW_TANGENTS.get(name, ()))
    return dims[0], per_row, ns["B"] * held


def diagonal_rows(params, X, target, wrt, start, stop, part="full"):
    """The diagonal of ``loss_hessian(params, X, target, wrt, part)`` (``wrt`` one parameter)
    on the rows ``start … stop − 1`` of its first axis (``diagonal_row_layout``): shape
    ``((stop − start)·per_row,)``, the entries ``start·per_row … stop·per_row − 1`` of the
    whole diagonal, with tangents along those rows only (a large parameter's diagonal in
    slices of bounded memory)."""
    name = _row_parameter(wrt)
    part = _check_part(part)
    ns = _prepare(params, X, target)
    rows = _engine_dims(name, ns)[0]
    if isinstance(start, bool) or isinstance(stop, bool) or not isinstance(start, int) \
            or not isinstance(stop, int) or not 0 <= start < stop <= rows:
        raise ValueError(f"start, stop: expected ints with 0 <= start < stop <= {rows} (the "
                         f"rows of {name}), got {start!r}, {stop!r}")
    ns["R"] = stop - start
    ns[_ROW_DIRECTIONS[name]] = _row_selector(ns, start, stop, rows)
    value = None
    for piece in ("gauss_newton", "functional") if part == "full" else (part,):
        _run(ns, f"diagonal_rows_{piece}_{name}")
        block = ns.pop(_DIAGONAL_ROWS[name, piece])
        value = block if value is None else value + block
    return _result(ns, value.reshape(-1), "diagonal_rows",
                   f"the diagonal of the {part} loss Hessian in {name} on rows {start} to "
                   f"{stop - 1}")


def _products(ns, v, names, groups, outputs, slots, function, quantity):
    """``groups[-1]``'s products over ``names`` for ``v`` (n,) or each column of ``v`` (n, k)."""
    rows = sum(_size(ns, name) for name in names)
    matrix = getattr(v, "ndim", 1) == 2 and tuple(v.shape)[0] == rows
    results = []
    for column in [v[:, k] for k in range(v.shape[1])] if matrix else [v]:
        _parameter_directions(ns, column, names, slots)
        for group in groups:
            _release(ns, group)
        _run(ns, groups[-1])
        results.append(_concatenate([ns[outputs[name]].reshape(-1) for name in names]))
    value = _stack_columns(results) if matrix else results[0]
    return _result(ns, value, function, f"{quantity} in {names}")


def hvp(params, X, target, v, wrt=None):
    """The Hessian of ``loss`` over ``wrt`` times ``v``, without forming the Hessian:
    shape ``(n,)`` (``v`` the ``wrt`` blocks of ``vec_r`` concatenated), or ``(n, k)`` for
    the ``k`` columns of ``v`` of shape ``(n, k)`` (one forward pass for all of them), or
    with ``wrt="X"`` per sample ``(B, L·d)`` for ``v`` of shape ``(B, L·d)``."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    ns = _prepare(params, X, target)
    if names == ["X"]:
        _input_direction(ns, v, "v", _DIRECTIONS["X"])
        _run(ns, "hvp_X")
        value = ns[_HVP["X"]].reshape(ns["B"], _size(ns, "X"))
        return _result(ns, _per_sample(ns, value), "hvp", "the Hessian-vector product in X")
    return _products(ns, v, names, ("hvp_params",), _HVP, _DIRECTIONS, "hvp",
                     "the Hessian-vector product")


def gnvp(params, X, target, v, wrt=None):
    """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` of the Hessian of ``loss`` over ``wrt``
    times ``v`` (the Hessian's second-order terms left out), without forming it: shapes as
    for ``hvp`` (``v`` of shape ``(n,)`` or ``(n, k)``; with ``wrt="X"`` per sample)."""
    names = _check_wrt(wrt, _parameter_names(), "X" in _GRADIENT)
    ns = _prepare(params, X, target)
    if names == ["X"]:
        _parameter_directions(ns, None, [], _JOINT_DIRECTIONS)
        _input_direction(ns, v, "v", _JOINT_DIRECTIONS["X"])
        _run(ns, "gnvp_joint")
        value = ns[_JOINT_GNVP["X"]].reshape(ns["B"], _size(ns, "X"))
        return _result(ns, _per_sample(ns, value), "gnvp",
                       "the Gauss–Newton-vector product in X")
    return _products(ns, v, names, ("gnvp_params",), _GNVP, _DIRECTIONS, "gnvp",
                     "the Gauss–Newton-vector product")


def _joint_names(wrt, v):
    """The parameters a joint direction ``v`` spans (none when ``v`` is None)."""
    names = [] if v is None and wrt is None else _check_wrt(wrt, _parameter_names(),
                                                            "X" in _GRADIENT)
    if "X" in names:
        raise ValueError(f"wrt: expected parameter names (the input's direction is v_X), "
                         f"got {names}")
    return names


def _joint_directions(ns, v, v_X, names):
    """Bind the joint direction: ``v`` over the parameters ``names``, ``v_X`` (None: 0)."""
    _parameter_directions(ns, v, names, _JOINT_DIRECTIONS)
    if _input_is_data(v_X):
        return
    if v_X is None:
        ns[_JOINT_DIRECTIONS["X"]] = _zeros(ns, (ns["B"],) + _engine_dims("X", ns))
    else:
        _input_direction(ns, v_X, "v_X", _JOINT_DIRECTIONS["X"])


def jvp(params, X, v=None, v_X=None, wrt=None):
    """The output and its directional derivative per sample, ``(Z, J_θ v + J_X v_X)``,
    without forming a Jacobian: ``Z`` as ``forward`` gives it, the derivative of shape
    ``(B, n_Z)`` (``vec_r`` of the output). ``v`` is the ``wrt`` blocks of ``vec_r``
    concatenated (default: all of ``PARAMS``; ``None``: zero), ``v_X`` the input's
    direction, ``(B, n_X)`` (``None``: zero)."""
    names = _joint_names(wrt, v)
    ns = _prepare(params, X)
    _joint_directions(ns, v, v_X, names)
    _run(ns, "jvp")
    value = ns[_JVP_NODE].reshape(ns["B"], _numel(ns, OUTPUT_SHAPE))
    return (_result(ns, _per_sample(ns, _output(ns, ns[_OUTPUT_NAME])), "jvp", "the output"),
            _result(ns, _per_sample(ns, value), "jvp", "the Jacobian-vector product"))


def hvp_joint(params, X, target, v=None, v_X=None, wrt=None, v_T=None):
    """The Hessian over the parameters ``wrt`` and the input together times one joint
    direction ``(v, v_X)`` (as for ``jvp``), without forming it: the triple
    ``(H_θθ v + mean_b H_θX_b v_X_b`` of shape ``(n,)``, per sample
    ``H_XX_b v_X_b + H_Xθ_b v`` of shape ``(B, n_X)``, and per sample the gradient of each
    sample's own loss in its input, ``(B, n_X))`` (the input's two None where ``X`` holds
    token ids: data), ``H_b`` the Hessian of sample ``b``'s own loss. ``v_T``
    (``(B, n_Z)``, ``vec_r`` of a target per sample; ``None``: zero) adds the mixed
    derivatives with the target along it: with the ``linear`` loss ``Σ T∘Z``,
    ``mean_b J_θ^T v_T`` and ``J_X^T v_T`` (how chained modules pass a cotangent's tangent
    down)."""
    names = _joint_names(wrt, v)
    ns = _prepare(params, X, target)
    _joint_directions(ns, v, v_X, names)
    output = (ns["B"],) + _engine_dims("Z", ns)
    if v_T is None:
        ns["u_T"] = _zeros(ns, output)
    else:
        v_T = _as_array(v_T, "v_T", like=ns["_like"])
        n = _numel(ns, OUTPUT_SHAPE)
        expected = (n,) if ns["_single"] else (ns["B"], n)
        if tuple(v_T.shape) != expected:
            raise ValueError(f"v_T: expected shape {expected} (the output's vec_r per "
                             f"sample), got shape {tuple(v_T.shape)}")
        _require_finite(v_T, "v_T")
        ns["u_T"] = _widened(v_T).reshape(output)
    _run(ns, "hvp_joint")
    in_params = (_concatenate([ns[_JOINT_HVP[name]].reshape(-1) for name in names])
                 if names else _zeros(ns, (0,)))
    return (_result(ns, in_params, "hvp_joint", f"the Hessian-vector product in {names}"),
            _in_input(ns, _JOINT_HVP.get("X"), "hvp_joint",
                      "the Hessian-vector product in X"),
            _in_input(ns, _JOINT_GRADIENT_NODE, "hvp_joint", "the gradient in X"))


def gnvp_joint(params, X, target, v=None, v_X=None, wrt=None):
    """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` over the parameters ``wrt`` and the input
    together times one joint direction ``(v, v_X)`` (as for ``jvp``): the pair
    ``(mean_b J_θ,b^T H_b (J_θ,b v + J_X,b v_X,b)`` of shape ``(n,)``, per sample
    ``J_X,b^T H_b (J_θ,b v + J_X,b v_X,b)`` of shape ``(B, n_X))`` (None where ``X`` holds
    token ids: data), ``H_b`` the loss's curvature ``∂²ℓ_b/∂Z_b²`` of sample ``b``."""
    names = _joint_names(wrt, v)
    ns = _prepare(params, X, target)
    _joint_directions(ns, v, v_X, names)
    _run(ns, "gnvp_joint")
    in_params = (_concatenate([ns[_JOINT_GNVP[name]].reshape(-1) for name in names])
                 if names else _zeros(ns, (0,)))
    return (_result(ns, in_params, "gnvp_joint",
                    f"the Gauss–Newton-vector product in {names}"),
            _in_input(ns, _JOINT_GNVP.get("X"), "gnvp_joint",
                      "the Gauss–Newton-vector product in X"))


def _in_input(ns, node, function, quantity):
    """The result ``node`` in the input per sample ``(B, n_X)``, checked (None: no node)."""
    if not node:
        return None
    value = _per_sample(ns, ns[node].reshape(ns["B"], _size(ns, "X")))
    return _result(ns, value, function, quantity)


def kronecker_factors(params, X, target, wrt_i, wrt_j=None, part="full"):
    """The loss-Hessian block ``(wrt_i, wrt_j)`` (``wrt_j`` default ``wrt_i``) of ``part`` as
    its Kronecker factors, for the blocks of ``STRUCTURED``: a tuple of pairs ``(A_k, B_k)``
    with ``block = Σ_k A_k ⊗ B_k`` in the ``vec_r`` layout (entry ``[(a, c), (a', c')]`` is
    ``Σ_k A_k[a, a'] B_k[c, c']`` for ``wrt_i[a, c]``, ``wrt_j[a', c']``), ``A_k`` of shape
    ``(p, p')`` and ``B_k`` of shape ``(q, q')`` for ``wrt_i`` of shape ``(p, q)`` and
    ``wrt_j`` of ``(p', q')``; ``None`` stands for an identity (never formed)."""
    first = _check_variable(wrt_i, "wrt_i", _parameter_names(), "X" in _GRADIENT)
    second = _check_variable(first if wrt_j is None else wrt_j, "wrt_j",
                             _parameter_names(), "X" in _GRADIENT)
    part = _check_part(part)
    if (first, second, part) not in _KRONECKER:
        raise ValueError(f"wrt_i, wrt_j: expected a block of STRUCTURED {list(STRUCTURED)} "
                         f"(exactly a sum of Kronecker products for this architecture), got "
                         f"({first!r}, {second!r}, part={part!r})")
    ns = _prepare(params, X, target)
    _run(ns, f"kronecker_{part}_{first}_{second}")
    return tuple(tuple(None if name is None else
                       _result(ns, ns[name], "kronecker_factors", "a Kronecker factor")
                       for name in product) for product in _KRONECKER[first, second, part])
