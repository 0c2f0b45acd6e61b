"""Proof by numbers: generated modules against ``torch.func`` on a plain PyTorch model.

:func:`reference_output` is an independent, hand-written PyTorch forward pass of a config,
composed of each sublayer's ``reference`` (no engine code: the graph, the calculus and the
lowering take no part): autograd through it (``torch.func.jacrev``, ``hessian``) is the
reference. LayerNorm is written out (mean, variance, ``rsqrt``) rather than taken from
``torch.nn.functional.layer_norm``, whose double backward through ``torch.func`` gave
wrong mixed ``weight``–``input`` second derivatives in torch 2.13 (see docs/ERRATA.md).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import sympy as sp
import torch
from torch.func import grad, hessian, jacfwd, jacrev, vmap

from ..derivations import attention, embedding, ffn, head, losses, normalization
from ..derivations.config import Config
from . import backends


def reference_output(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The configured sublayer on one sample ``X`` (``L×d``), in plain PyTorch: each
    sublayer's own reference forward, composed as the config says."""
    if config.kind == "layernorm":
        return normalization.reference(config, params, X)
    if config.kind == "self_attention":
        return attention.reference(config, params, X)
    if config.kind == "ffn":
        return ffn.reference(config, params, X)
    if config.kind == "embedding":
        return embedding.reference(config, params, X)
    if config.kind == "head":
        return head.reference(config, params, X)
    attend = attention.own(config)
    if config.norm_position == "post":
        Y = normalization.reference(config, params, X + attention.reference(attend, params, X),
                                    "_1")
        if config.cross_attention:
            Y = normalization.reference(config, params, Y + _cross(config, params, Y), "_3")
        return normalization.reference(config, params, Y + ffn.reference(config, params, Y),
                                       "_2")

    def scaled(out: torch.Tensor, k: int) -> torch.Tensor:
        if config.sandwich_norm:
            out = normalization.reference(config, params, out, f"_{k + 2}")
        return out * params[f"lambda_{k}"] if config.layer_scale else out

    N_1 = normalization.reference(config, params, X, "_1")
    if config.norm_position == "parallel":
        N_2 = N_1 if config.shared_norm else normalization.reference(config, params, X, "_2")
        return (X + scaled(attention.reference(attend, params, N_1), 1)
                + scaled(ffn.reference(config, params, N_2), 2))
    Y = X + scaled(attention.reference(attend, params, N_1), 1)
    if config.cross_attention:
        Y = Y + _cross(config, params, normalization.reference(config, params, Y, "_3"))
    return Y + scaled(ffn.reference(config, params, normalization.reference(config, params, Y,
                                                                            "_2")), 2)


def _cross(config: Config, params: dict, Y: torch.Tensor) -> torch.Tensor:
    """A block's cross-attention on ``Y`` (``L×d``): its parameters ``W_Q_c, …`` and the
    sample's ``M``."""
    own = {name.removesuffix("_c"): value for name, value in params.items()
           if name.endswith("_c")}
    return attention.reference(attention.crossed(config), {**own, "M": params["M"]}, Y)


def reference_loss(config: Config, Z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The per-sample loss of the output ``Z`` (``L×d``)."""
    if config.loss == "mse":
        return ((Z - target) ** 2).sum() / Z.numel()
    if config.loss == "cross_entropy":
        return torch.nn.functional.cross_entropy(Z, target)
    if config.loss == "linear":
        return (Z * target).sum()
    residual = sp.lambdify(losses.r, losses.residual_loss(config.loss), modules=_TORCH_FUNCTIONS)
    return residual(Z - target).sum() / Z.numel()


def sample_loss(config: Config, params: dict, x: torch.Tensor, t: torch.Tensor
                ) -> torch.Tensor:
    """The loss of one sample ``x`` (``L×d``) against its target ``t``, in plain PyTorch."""
    return reference_loss(config, reference_output(config, params, x), t)


def batch_loss(config: Config, params: dict, X: torch.Tensor, target: torch.Tensor
               ) -> torch.Tensor:
    """The loss averaged over the batch ``X`` (``B×L×d``)."""
    return vmap(lambda x, t: sample_loss(config, params, x, t))(X, target).mean()


_TORCH_FUNCTIONS = [{name: getattr(torch, name) for name in
                     ("exp", "log", "cosh", "sinh", "tanh", "sqrt", "abs", "erf")}, "math"]


def random_case(module: ModuleType, dims: dict[str, int], batch: int, seed: int = 0,
                dtype: torch.dtype = torch.float64) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Random parameters (``gamma`` near 1) with the module's per-sample constants, input and
    target for ``module``."""
    gen = torch.Generator().manual_seed(seed)
    dims = {**dims, **getattr(module, "_CONSTANT_DIMS", {})}
    if "h" in dims:  # the value width of a head
        dims["d_v"] = dims["d"] // dims["h"]

    def size(name: str) -> int:
        missing = [factor for factor in name.split("*") if factor not in dims]
        if missing:
            raise ValueError(f"dims: expected the size {missing[0]!r} (a parameter of "
                             f"{module.__name__} has shape {name}), got {sorted(dims)}")
        return int(np.prod([dims[factor] for factor in name.split("*")]))

    params = {}
    for name, shape in module.PARAMS:
        value = torch.randn(*(size(s) for s in shape), generator=gen, dtype=dtype)
        if name.startswith("gamma"):
            value = 1 + 0.3 * value
        params[name] = value
    X = torch.randn(batch, *(size(s) for s in module.INPUT_SHAPE), generator=gen, dtype=dtype)
    for name, shape in module.CONSTANTS:  # a second input (cross-attention's M), per sample
        params[name] = torch.randn(batch, *(size(s) for s in shape), generator=gen, dtype=dtype)
    if module.LOSS == "cross_entropy":  # class indices of the rows of the output
        *rows, classes = (dims[s] for s in module.OUTPUT_SHAPE)
        target = torch.randint(0, classes, (batch, *rows), generator=gen)
    else:
        target = torch.randn(batch, *(dims[s] for s in module.TARGET_SHAPE), generator=gen,
                             dtype=dtype)
    return params, X, target


class Reference:
    """``torch.func`` references for every function of the generated-module contract."""

    def __init__(self, config: Config, module: ModuleType, params: dict, X: torch.Tensor,
                 target: torch.Tensor) -> None:
        self.config, self.params, self.X, self.target = config, params, X, target
        self.names = [name for name, _ in module.PARAMS]
        #: the per-sample constants (cross-attention's M, ``(B, ...)``): each sample's rows
        #: are in ``params`` while a function of that sample runs (:meth:`_each`)
        self.per_sample = {name: params[name] for name, _ in module.CONSTANTS}

    def _each(self, function):
        """``vmap(function)`` over the samples, each sample's constants in ``self.params``
        while ``function`` runs."""
        def sample(*args):
            *args, constants = args
            shared = self.params
            self.params = {**shared, **constants}
            try:
                return function(*args)
            finally:
                self.params = shared
        return lambda *arrays: vmap(sample)(*arrays, self.per_sample)

    def _batch_loss(self, params: dict) -> torch.Tensor:
        """The batch loss with the parameters ``params`` (and each sample's constants)."""
        return self._each(lambda x, t: sample_loss(self.config, {**self.params, **params},
                                                   x, t))(self.X, self.target).mean()

    def forward(self) -> torch.Tensor:
        return self._each(lambda x: reference_output(self.config, self.params, x))(self.X)

    def loss(self) -> torch.Tensor:
        return self._batch_loss({})

    def gradient(self, wrt: list[str]) -> torch.Tensor:
        """The batch loss's gradient over the parameters ``wrt`` (concatenated), or with
        ``["X"]`` each sample's own loss's gradient in its input ``(B, L·d)``."""
        if wrt == ["X"]:
            per_sample = self._each(grad(lambda x, t: sample_loss(self.config, self.params,
                                                                  x, t)))
            return per_sample(self.X, self.target).reshape(self.X.shape[0], -1)
        grads = grad(self._batch_loss)({n: self.params[n] for n in wrt})
        return torch.cat([grads[n].reshape(-1) for n in wrt])

    def _out(self, x: torch.Tensor, values: dict) -> torch.Tensor:
        """The sample output with some parameters (or ``"X"``) replaced by ``values``."""
        merged = {**self.params, "X": x, **values}
        return reference_output(self.config, merged, merged.pop("X"))

    def _start(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x if name == "X" else self.params[name]

    def jacobian(self, wrt: str) -> torch.Tensor:
        def sample(x):
            return jacrev(lambda a: self._out(x, {wrt: a}))(self._start(wrt, x))
        return self._each(sample)(self.X).reshape(self.X.shape[0], self.forward()[0].numel(),
                                                  -1)

    def output_hessian(self, first: str, second: str) -> torch.Tensor:
        def sample(x):
            if first == second:
                return hessian(lambda a: self._out(x, {first: a}))(self._start(first, x))
            # forward over reverse, as ``hessian``: one tangent per entry of ``second``
            return jacfwd(jacrev(lambda a, b: self._out(x, {first: a, second: b}), 0), 1)(
                self._start(first, x), self._start(second, x))
        n_second = self._start(second, self.X[0]).numel()
        return self._each(sample)(self.X).reshape(self.X.shape[0], -1, n_second)

    def loss_hessian(self, wrt: list[str]) -> torch.Tensor:
        if wrt == ["X"]:
            def one(x, t):
                return sample_loss(self.config, self.params, x, t)
            H = self._each(hessian(one))(self.X, self.target)
            n = self.X[0].numel()
            return H.reshape(-1, n, n)
        shapes = [self.params[name].shape for name in wrt]
        sizes = [int(np.prod(s)) for s in shapes]

        def flat(vector):
            parts = torch.split(vector, sizes)
            return self._batch_loss({name: part.reshape(shape)
                                     for name, part, shape in zip(wrt, parts, shapes)})

        return hessian(flat)(torch.cat([self.params[name].reshape(-1) for name in wrt]))

    def loss_hessian_mixed(self, wrt: list[str]) -> torch.Tensor:
        """Per sample ``∂²ℓ_b/∂X_b∂θ``, ``(B, L·d, n)``, ``θ`` the parameters ``wrt``."""
        def one(x, t):
            def input_gradient(p):
                merged = {**self.params, **p}
                return grad(lambda xx: sample_loss(self.config, merged, xx, t))(x)
            blocks = jacrev(input_gradient)({n: self.params[n] for n in wrt})
            return torch.cat([blocks[n].reshape(x.numel(), -1) for n in wrt], dim=1)
        return self._each(one)(self.X, self.target)

    def gauss_newton(self, wrt: list[str]) -> torch.Tensor:
        """``mean_b J_b^T (∂²ℓ/∂Z²) J_b`` with every factor from autograd."""
        J = torch.cat([self.jacobian(name) for name in wrt], dim=-1)
        Hz = self.output_curvature()
        if wrt == ["X"]:
            return torch.einsum("bri,brs,bsj->bij", J, Hz, J)
        return torch.einsum("bri,brs,bsj->ij", J, Hz, J) / self.X.shape[0]

    def gauss_newton_mixed(self, wrt: list[str]) -> torch.Tensor:
        """Per sample ``J_X^T (∂²ℓ/∂Z²) J_θ`` with every factor from autograd."""
        J = torch.cat([self.jacobian(name) for name in wrt], dim=-1)
        return torch.einsum("bri,brs,bsj->bij", self.jacobian("X"), self.output_curvature(), J)

    def output_curvature(self) -> torch.Tensor:
        """``∂²ℓ_b/∂Z_b²`` per sample, ``(B, n_Z, n_Z)``."""
        def curvature(z, t):
            return hessian(lambda zz: reference_loss(self.config, zz, t))(z)

        Z = self.forward()
        n = Z[0].numel()
        return vmap(curvature)(Z, self.target).reshape(-1, n, n)


def relative_error(value, reference: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``max |value - reference| / max |scale|``, ``scale`` the reference by default (a
    reference that is a difference of two larger arrays is measured against them)."""
    value = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
    reference = reference.detach()
    if tuple(value.shape) != tuple(reference.shape):
        raise AssertionError(f"shape {tuple(value.shape)} != reference {tuple(reference.shape)}")
    if not reference.numel():
        return 0.0
    size = float((reference if scale is None else scale).abs().max())
    error = float((value.to(reference.dtype) - reference).abs().max())
    return error / size if size > 0 else error


def largest_entry(arrays) -> torch.Tensor:
    """A scalar tensor: the largest ``|entry|`` of all ``arrays``."""
    return torch.stack([a.detach().abs().max() for a in arrays if a.numel()]).max()


def check_module(config: Config, module: ModuleType, backend: str, dims: dict[str, int],
                 batch: int = 2, seed: int = 0, input_scale: float = 1.0) -> dict[str, float]:
    """Relative errors of every contract function of ``module`` against ``torch.func``: each
    Jacobian against the largest entry of all Jacobians, each output-Hessian block against
    all blocks, each loss-Hessian part against the whole loss Hessian."""
    params, X, target = random_case(module, dims, batch, seed)
    X = X * input_scale
    ref = Reference(config, module, params, X, target)
    conv = backends.backend(backend).from_torch
    P, Xb, Tb = {k: conv(v) for k, v in params.items()}, conv(X), conv(target)
    names = [name for name, _ in module.PARAMS]
    variables = [*names, "X"]
    errors = {"forward": relative_error(module.forward(P, Xb), ref.forward()),
              "loss": relative_error(module.loss(P, Xb, Tb), ref.loss())}
    for wrt in ([names] if names else []) + [["X"]]:
        label = "params" if wrt != ["X"] else "X"
        errors[f"gradient[{label}]"] = relative_error(
            module.gradient(P, Xb, Tb, wrt=wrt if wrt != ["X"] else "X"), ref.gradient(wrt))
    # each block against the whole quantity it is a block of: a block that is zero in exact
    # arithmetic (a key bias, a saturated softmax) is not measured against its own rounding
    jacobians = {v: ref.jacobian(v) for v in variables}
    scale = largest_entry(jacobians.values())
    for v in variables:
        errors[f"jacobian[{v}]"] = relative_error(module.jacobian(P, Xb, v), jacobians[v], scale)
    second = {(v, w): ref.output_hessian(v, w) for v in variables for w in variables}
    scale = largest_entry(second.values())
    for (v, w), reference in second.items():
        errors[f"output_hessian[{v},{w}]"] = relative_error(
            module.output_hessian(P, Xb, v, w), reference, scale)
    gen = torch.Generator().manual_seed(seed + 1)
    for wrt in ([names] if names else []) + [["X"]]:
        label = "params" if wrt != ["X"] else "X"
        full = ref.loss_hessian(wrt)
        gn = ref.gauss_newton(wrt)
        if wrt == names:
            errors.update(_check_kronecker(module, ref, conv, names, full, gn))
        arg = wrt if wrt != ["X"] else "X"
        errors[f"loss_hessian[{label}]"] = relative_error(
            module.loss_hessian(P, Xb, Tb, wrt=arg), full)
        errors[f"loss_hessian[{label}].gauss_newton"] = relative_error(
            module.loss_hessian(P, Xb, Tb, wrt=arg, part="gauss_newton"), gn)
        errors[f"loss_hessian[{label}].functional"] = relative_error(
            module.loss_hessian(P, Xb, Tb, wrt=arg, part="functional"), full - gn, full)
        if wrt == ["X"]:
            v = torch.randn(X.shape[0], X[0].numel(), generator=gen, dtype=X.dtype)
            expected = torch.einsum("bij,bj->bi", full, v)
        else:
            v = torch.randn(full.shape[0], generator=gen, dtype=X.dtype)
            expected = full @ v
        errors[f"hvp[{label}]"] = relative_error(module.hvp(P, Xb, Tb, conv(v), wrt=arg),
                                                 expected)
        if wrt == ["X"]:
            errors[f"gnvp[{label}]"] = relative_error(
                module.gnvp(P, Xb, Tb, conv(v), wrt=arg), torch.einsum("bij,bj->bi", gn, v))
            diagonals = {p: torch.diagonal(h, dim1=-2, dim2=-1)
                         for p, h in (("full", full), ("gauss_newton", gn))}
        else:  # k directions at once: the columns of a matrix
            V = torch.randn(full.shape[0], 3, generator=gen, dtype=X.dtype)
            errors[f"hvp[{label}].matrix"] = relative_error(
                module.hvp(P, Xb, Tb, conv(V), wrt=arg), full @ V)
            errors[f"gnvp[{label}]"] = relative_error(
                module.gnvp(P, Xb, Tb, conv(v), wrt=arg), gn @ v)
            errors[f"gnvp[{label}].matrix"] = relative_error(
                module.gnvp(P, Xb, Tb, conv(V), wrt=arg), gn @ V)
            diagonals = {p: torch.diagonal(h) for p, h in (("full", full), ("gauss_newton", gn))}
        diagonals["functional"] = diagonals["full"] - diagonals["gauss_newton"]
        for part, reference in diagonals.items():
            errors[f"diagonal[{label}].{part}"] = relative_error(
                module.diagonal(P, Xb, Tb, wrt=arg, part=part), reference, diagonals["full"])
    if names:
        full, gn = ref.loss_hessian_mixed(names), ref.gauss_newton_mixed(names)
        errors["loss_hessian_mixed[X,params]"] = relative_error(
            module.loss_hessian_mixed(P, Xb, Tb), full)
        errors["loss_hessian_mixed[X,params].gauss_newton"] = relative_error(
            module.loss_hessian_mixed(P, Xb, Tb, part="gauss_newton"), gn, full)
        errors["loss_hessian_mixed[X,params].functional"] = relative_error(
            module.loss_hessian_mixed(P, Xb, Tb, part="functional"), full - gn, full)
    errors.update(_check_joint(module, ref, conv, names, jacobians, gen))
    return errors


def _check_kronecker(module: ModuleType, ref: Reference, conv, names: list[str],
                     full: torch.Tensor, gauss_newton: torch.Tensor) -> dict[str, float]:
    """Each block of ``STRUCTURED``, its Kronecker products summed densely, against the
    autograd block (measured against the whole ``part``)."""
    sizes = [ref.params[name].numel() for name in names]
    starts = dict(zip(names, np.cumsum([0, *sizes[:-1]])))
    dense = {"full": full, "gauss_newton": gauss_newton, "functional": full - gauss_newton}
    errors = {}
    P = {k: conv(value) for k, value in ref.params.items()}
    for v, w, part in module.STRUCTURED:
        (p, q), (p2, q2) = ref.params[v].shape, ref.params[w].shape
        block = 0
        for A, B in module.kronecker_factors(P, conv(ref.X), conv(ref.target), v, w, part):
            A = torch.eye(p, p2, dtype=full.dtype) if A is None else torch.as_tensor(A)
            B = torch.eye(q, q2, dtype=full.dtype) if B is None else torch.as_tensor(B)
            block = block + torch.kron(A, B)
        rows = slice(starts[v], starts[v] + p * q)
        columns = slice(starts[w], starts[w] + p2 * q2)
        errors[f"kronecker[{v},{w}].{part}"] = relative_error(
            block, dense[part][rows, columns], full)
    return errors


def _check_joint(module: ModuleType, ref: Reference, conv, names: list[str],
                 jacobians: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, float]:
    """``jvp``, ``hvp_joint`` and ``gnvp_joint`` along one random direction in every variable
    (and, for ``hvp_joint`` but for class-index targets, in the target), against the
    autograd Jacobians, output curvature and Hessian blocks contracted with it."""
    X, batch = ref.X, ref.X.shape[0]
    v_X = torch.randn(batch, X[0].numel(), generator=gen, dtype=X.dtype)
    expected_jvp = torch.einsum("bri,bi->br", jacobians["X"], v_X)
    H_XX = ref.loss_hessian(["X"])
    expected_X = torch.einsum("bij,bj->bi", H_XX, v_X)
    v = expected_params = None
    if names:
        n = sum(ref.params[name].numel() for name in names)
        v = torch.randn(n, generator=gen, dtype=X.dtype)
        J = torch.cat([jacobians[name] for name in names], dim=-1)
        expected_jvp = expected_jvp + torch.einsum("bri,i->br", J, v)
        H_Xt = ref.loss_hessian_mixed(names)
        expected_params = (ref.loss_hessian(names) @ v
                           + torch.einsum("bri,br->i", H_Xt, v_X) / batch)
        expected_X = expected_X + torch.einsum("bri,i->br", H_Xt, v)
    v_T = None
    if ref.config.loss != "cross_entropy":  # a target of class indices has no direction
        v_T = torch.randn(batch, expected_jvp.shape[1], generator=gen, dtype=X.dtype)

        def gradients(target: torch.Tensor) -> tuple[torch.Tensor, ...]:
            moved = Reference(ref.config, module, ref.params, X, target)
            return moved.gradient(names) if names else X.new_zeros(0), moved.gradient(["X"])

        _, (in_params, in_input) = torch.func.jvp(gradients, (ref.target,),
                                                  (v_T.reshape(ref.target.shape),))
        expected_X = expected_X + in_input
        if names:
            expected_params = expected_params + in_params
    P = {k: conv(value) for k, value in ref.params.items()}
    direction = None if v is None else conv(v)
    output, tangent = module.jvp(P, conv(X), direction, conv(v_X))
    errors = {"jvp": relative_error(tangent, expected_jvp),
              "jvp.output": relative_error(output, ref.forward())}
    curved = torch.einsum("brs,bs->br", ref.output_curvature(), expected_jvp)
    gn_params, gn_input = module.gnvp_joint(P, conv(X), conv(ref.target), direction,
                                            conv(v_X))
    errors["gnvp_joint[X]"] = relative_error(
        gn_input, torch.einsum("bri,br->bi", jacobians["X"], curved))
    if names:
        errors["gnvp_joint[params]"] = relative_error(
            gn_params, torch.einsum("bri,br->i", J, curved) / batch)
    in_params, in_input, gradient = module.hvp_joint(
        P, conv(X), conv(ref.target), direction, conv(v_X),
        v_T=None if v_T is None else conv(v_T))
    errors["hvp_joint[X]"] = relative_error(in_input, expected_X)
    errors["hvp_joint.gradient[X]"] = relative_error(gradient, ref.gradient(["X"]))
    if names:
        errors["hvp_joint[params]"] = relative_error(in_params, expected_params)
    return errors
