"""Chaining: one forward pass kept and continued (the ``*_saved`` functions).

A chain of modules keeps each one's forward values (as autograd keeps what its backward
needs) and continues from them: a gradient is one forward and one adjoint sweep, an HVP adds
one tangent sweep up and one second-order sweep down, and several directions share the
forward and the adjoints. Arrays stay in the dtype they are computed in and are not checked
for overflow here: the caller checks its final result once. Where ``X`` holds the one-hot
rows of token ids (data, not a variable), the results in the input are None."""

# -- stand-ins: the generated module defines these (not copied) --
from ._module_names import (
    _GRADIENT,
    _GROUPS,
    _JOINT_DIRECTIONS,
    _JOINT_GNVP,
    _JOINT_GRADIENT_NODE,
    _JOINT_HVP,
    _JVP_NODE,
    _OUTPUT_NAME,
    _PER_SAMPLE_GRADIENT,
    _PER_SAMPLE_JOINT_GNVP,
    _PER_SAMPLE_JOINT_HVP,
    INPUT_SHAPE,
    PARAMS,
)
from .arguments import _bind_dims, _check_slots, _dim
from .namespace import (
    _bind_target,
    _engine_dims,
    _input_is_data,
    _output,
    _prepare,
    _release,
    _run,
    _size,
)

# the backend's primitives: numpy_arrays.py stands for torch_arrays.py (the same names)
from .numpy_arrays import _as_array, _into, _zeros

# -- end stand-ins --


def _after_target(group):
    """Whether ``group`` reads the target (it requires the loss, directly or not)."""
    return group == "loss" or any(_after_target(r) for r in _GROUPS[group][1])


def _saved_target(saved, target):
    """Bind ``target`` to the saved call, dropping what an earlier target computed."""
    if saved.get("_target") is target:
        return
    for group in [g for g in _GROUPS if _after_target(g)]:
        _release(saved, group)
    _bind_target(saved, target)
    saved["_target"] = target


def _input_shaped(saved, node):
    """The node ``node`` (per sample) in the input's shape ``(B, *INPUT_SHAPE)`` (None: none)."""
    if not node:
        return None
    return saved[node].reshape((saved["B"],) + tuple(_dim(s, saved) for s in INPUT_SHAPE))


def forward_saved(params, X):
    """The output ``Z`` of shape ``(B, *OUTPUT_SHAPE)`` and the call's saved values (a dict)
    that ``jvp_saved``, ``vjp_saved``, ``hvp_saved`` and ``gnvp_saved`` continue from. ``X``
    is a batch ``(B, *INPUT_SHAPE)``."""
    ns = _prepare(params, X)
    if ns["_single"]:
        raise ValueError(f"X: expected a batch of shape (B, {', '.join(INPUT_SHAPE)}), got "
                         f"shape {tuple(X.shape)}")
    _run(ns, "forward")
    return _output(ns, ns[_OUTPUT_NAME]), ns


def jvp_saved(saved, v=None, v_X=None, keep_inner=True):
    """Bind one joint direction and return ``dZ = J_θ v + J_X v_X`` per sample, shape
    ``(B, *OUTPUT_SHAPE)``: ``v`` a dict of parameter name → direction shaped as the
    parameter (those left out: zero; None: all zero), ``v_X`` the input's direction shaped
    as ``X`` (None: zero). Products along an earlier direction are dropped.
    ``keep_inner=False`` drops the tangents of the inner nodes once ``dZ`` is made: then
    ``vjp_saved`` still runs (it reads none of them), ``hvp_saved`` and ``gnvp_saved`` not."""
    for group in ("jvp", "hvp_joint", "per_sample_hvp_joint", "gnvp_joint",
                  "per_sample_gnvp_joint"):
        _release(saved, group)
    v = {} if v is None else v
    unknown = sorted(set(v) - {name for name, _ in PARAMS})
    if unknown:
        raise ValueError(f"v: expected directions of the parameters "
                         f"{[name for name, _ in PARAMS]}, got unknown {unknown}")
    for name, shape in PARAMS:
        if name in v:
            argument = f"v[{name!r}]"
            value = _as_array(v[name], argument, like=saved["X"])
            _bind_dims(value, shape, argument, saved)
            saved[_JOINT_DIRECTIONS[name]] = value.reshape(_engine_dims(name, saved))
        else:
            saved[_JOINT_DIRECTIONS[name]] = _zeros(saved, _engine_dims(name, saved))
    batched = (saved["B"],) + _engine_dims("X", saved)
    if v_X is None and not _input_is_data(v_X):
        saved[_JOINT_DIRECTIONS["X"]] = _zeros(saved, batched)
    elif not _input_is_data(v_X):
        value = _as_array(v_X, "v_X", like=saved["X"])
        if tuple(value.shape) != tuple(saved["_like"].shape):
            raise ValueError(f"v_X: expected the shape of X, {tuple(saved['_like'].shape)}, "
                             f"got shape {tuple(value.shape)}")
        saved[_JOINT_DIRECTIONS["X"]] = value.reshape(batched)
    _run(saved, "jvp")
    dZ = _output(saved, saved[_JVP_NODE])
    if not keep_inner:
        _release(saved, "jvp")
    return dZ


def _run_into(saved, group, results, out):
    """Run ``group``: parameter name → its result (nodes ``results``), into ``out``'s arrays."""
    # Each array of ``out`` is contiguous, of its parameter's size, in the dtype and on the
    # device of X; the matrix product that makes a result writes into it where there is one,
    # else the result is copied there. ``saved`` keeps no reference to those arrays after,
    # and the group runs again on its next call.
    if not out:
        _run(saved, group)
        return {name: saved[results[name]] for name, _ in PARAMS}
    _check_slots(out, {name: _size(saved, name) for name, _ in PARAMS}, saved["X"])
    _release(saved, group)
    saved["_out"] = {results[name]: array for name, array in out.items()}
    try:
        _run(saved, group)
    finally:
        del saved["_out"]
    values = {}
    for name, _ in PARAMS:
        values[name] = saved[results[name]]
        if name in out:
            values[name] = _into(out[name], saved.pop(results[name]))
    saved["_done"].discard(group)
    return values


def vjp_saved(saved, target, out=None):
    """The gradient of the loss against ``target`` (the ``linear`` loss's target is the
    cotangent ``∂ℓ_b/∂Z_b`` of each sample, shaped as ``Z``): a dict of parameter name →
    its gradient averaged over the batch (engine shape; ``reshape(-1)`` is its ``vec_r``),
    and per sample the gradient of each sample's own loss in its input, shaped as ``X``.
    ``out`` (parameter name → a contiguous array of its size, in X's dtype): those
    gradients are written there (a slice of a flat result, with no copy where a matrix
    product makes them) and returned as views of it."""
    _saved_target(saved, target)
    gradients = _run_into(saved, "gradient", _GRADIENT, out)
    return gradients, _input_shaped(saved, _GRADIENT.get("X"))


def vjp_per_sample_saved(saved, target):
    """As ``vjp_saved``, each sample's own gradient apart: a dict of parameter name → the
    gradient of each sample's own loss against ``target``, ``(B, *engine shape)``
    (``reshape(B, -1)`` gives each sample's ``vec_r``), and per sample the gradient in the
    input, shaped as ``X``."""
    _saved_target(saved, target)
    _run(saved, "per_sample_gradient")
    return ({name: saved[_PER_SAMPLE_GRADIENT[name]] for name, _ in PARAMS},
            _input_shaped(saved, _PER_SAMPLE_GRADIENT.get("X")))


def hvp_saved(saved, target, v_T=None, out=None):
    """Along the direction ``jvp_saved`` bound, the Hessian of the loss against ``target``
    over every variable times it: a dict of parameter name → ``(H v)_θ`` averaged over the
    batch (engine shape), per sample ``(H v)_X`` shaped as ``X``, and per sample the
    gradient in the input, shaped as ``X`` (one array while ``target`` stands, so that a
    part below bound to it keeps its adjoints). ``v_T`` (shaped as ``Z``; None: zero) is the
    target's direction: with the ``linear`` loss it adds ``J^T v_T``, the tangent of a
    chained cotangent. ``out``: the products written there, as for ``vjp_saved``."""
    if "jvp" not in saved["_done"]:
        raise ValueError("saved: expected a direction bound by jvp_saved first (keep_inner=True)")
    _saved_target(saved, target)
    _release(saved, "hvp_joint")
    output = (saved["B"],) + _engine_dims("Z", saved)
    saved["u_T"] = (_zeros(saved, output) if v_T is None
                    else _as_array(v_T, "v_T", like=saved["X"]).reshape(output))
    products = _run_into(saved, "hvp_joint", _JOINT_HVP, out)
    gradient = saved.get(_JOINT_GRADIENT_NODE)
    if "_gradient" not in saved or saved["_gradient"] is not gradient:
        # one object while the adjoints stand: the part below, bound to it as its target,
        # then keeps its own adjoints from one direction to the next
        saved["_gradient"] = gradient
        saved["_gradient_shaped"] = _input_shaped(saved, _JOINT_GRADIENT_NODE)
    return (products, _input_shaped(saved, _JOINT_HVP.get("X")), saved["_gradient_shaped"])


def hvp_per_sample_saved(saved, target):
    """As ``hvp_saved`` (with no direction in the target), each sample's own products in the
    parameters apart: a dict of parameter name → ``(B, *engine shape)``, and per sample
    ``(H v)_X`` shaped as ``X`` (what a tied parameter's diagonal pairs, one copy of a sample
    per column)."""
    _, in_X, _ = hvp_saved(saved, target)
    return _each_sample(saved, "per_sample_hvp_joint", _PER_SAMPLE_JOINT_HVP), in_X


def _each_sample(saved, group, nodes):
    """Run ``group``: its per-sample products, parameter name → ``(B, *engine shape)``."""
    # once per direction and target: jvp_saved and a new target drop what it computed
    _run(saved, group)
    return {name: saved[nodes[name]] for name, _ in PARAMS}


def gnvp_saved(saved, target, out=None):
    """Along the direction ``jvp_saved`` bound, the Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J``
    against ``target`` times it: a dict of parameter name → its product averaged over the
    batch (engine shape), and per sample the product in the input, shaped as ``X``.
    ``out``: the products written there, as for ``vjp_saved``."""
    if "jvp" not in saved["_done"]:
        raise ValueError("saved: expected a direction bound by jvp_saved first (keep_inner=True)")
    _saved_target(saved, target)
    products = _run_into(saved, "gnvp_joint", _JOINT_GNVP, out)
    return products, _input_shaped(saved, _JOINT_GNVP.get("X"))


def gnvp_per_sample_saved(saved, target):
    """As ``gnvp_saved``, each sample's own products in the parameters apart: a dict of
    parameter name → ``(B, *engine shape)``, and per sample the product in the input, shaped
    as ``X``."""
    _, in_X = gnvp_saved(saved, target)
    return _each_sample(saved, "per_sample_gnvp_joint", _PER_SAMPLE_JOINT_GNVP), in_X
