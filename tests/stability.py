"""The stability matrix: curvgap's error against autograd's own error, dtype by dtype.

For one config and one input scale, :func:`measure` draws a random case in float64 (batch 2,
``L, d, d_k, d_ff`` all different), scales ``X`` or ``W_Q, W_K``, and evaluates every function
of the generated-module contract three ways:

* the *reference*: reverse-over-reverse autograd (``jacrev`` of ``jacrev``) of the independent
  plain-PyTorch forward in :mod:`curvgap.codegen.verify`, in float64, on the inputs as rounded
  to the dtype under test;
* *autograd* in the dtype under test: the same reverse-over-reverse route on the inputs cast
  to that dtype, and in float64 the other autograd route (``torch.func.hessian``,
  forward-over-reverse), so that autograd's own float64 error is measured too;
* curvgap, both backends, on the same cast inputs.

Errors are ``max |value - reference| / max |reference|`` over each function's whole result (a
whole Hessian, a whole Jacobian); the loss, a single number, takes the worst of
``LOSS_DRAWS`` cases drawn alike, for autograd and for curvgap. The criterion (:func:`bound`) is the standard's: curvgap's
error at most 10× autograd's in the same dtype, and never above a floor at rounding level:
``1e-10`` in float64 (the project's exactness standard), ``10·eps ≈ 1.2e-6`` in float32.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from torch.func import hessian, jacrev, vmap

from curvgap.codegen.verify import largest_entry, random_case, reference_loss, reference_output
from curvgap.derivations.config import Config

DIMS = {"L": 3, "d": 4, "d_k": 5, "d_ff": 7, "p": 6, "c": 2}
BATCH = 2
#: input scales of the matrix, applied to ``X`` or to ``W_Q`` and ``W_K``
SCALES = (1e-3, 1.0, 10.0, 100.0, 1e3)
#: shifts added to every entry of ``X`` (normalisation of rows with a large mean)
SHIFTS = (10.0, 1e3, 1e5)
FLOOR = {torch.float64: 1e-10, torch.float32: 10 * float(torch.finfo(torch.float32).eps)}
DTYPES = (torch.float64, torch.float32)
#: the loss is one number, so its error is one draw of the rounding: a draw where autograd's
#: rounding happens to cancel (rows of mean 1e3 in float32: 1.2e-6 where its other draws make
#: 4e-6 … 6.5e-5) would make one rounding more of curvgap's fail. Its row is the worst over
#: this many cases, drawn alike (seeds 0, 1, …), for autograd and for curvgap.
LOSS_DRAWS = 4
#: the columns of an output Hessian that reverse over reverse makes at once: all ``L·d·n`` of
#: them at once hold a batched copy of every intermediate per column (13 GB for the partially
#: rotary NeoX block at ``n = 725``), 256 at once hold 0.6 GB and give the same bits, sooner
OUTPUT_HESSIAN_CHUNK = 256


def bound(dtype: torch.dtype, autograd_error: float) -> float:
    """The largest error curvgap may make in ``dtype`` where autograd makes ``autograd_error``."""
    return max(10 * autograd_error, FLOOR[dtype])


@dataclass
class Case:
    config: Config
    names: list[str]
    params: dict
    X: torch.Tensor
    target: torch.Tensor


def make_case(config: Config, module: ModuleType, scaled: str, scale: float,
              seed: int = 0, dims: dict[str, int] = DIMS, batch: int = BATCH) -> Case:
    """A float64 case with ``X`` (``scaled == "X"``) or ``W_Q, W_K`` (``"W_QK"``) times ``scale``,
    or (``"shift"``) ``scale`` added to every entry of ``X`` (rows of large mean and unit spread)."""
    params, X, target = random_case(module, dims, batch, seed)
    if scaled == "X":
        X = X * scale
    elif scaled == "shift":
        X = X + scale
    else:  # the queries and keys of every attention (a decoder block's cross-attention too)
        params = {k: v * scale if k in ("W_Q", "W_K", "W_Q_c", "W_K_c") else v
                  for k, v in params.items()}
    return Case(config, [name for name, _ in module.PARAMS], params, X, target)


def _cast(value, dtype):
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value.to(dtype) if value.is_floating_point() else value


class Autograd:
    """Every contract function by autograd of the plain forward, on ``case`` cast to ``dtype``;
    ``route`` is ``"reverse"`` (``jacrev`` of ``jacrev``) or ``"forward"`` (``torch.func.hessian``,
    forward over reverse).

    Entries of ``case.params`` that are not parameters are per-sample constants (a
    cross-attention's ``M``, ``(B, L_m, d)``): every per-sample function is mapped over them
    with ``X`` (:meth:`_each`)."""

    def __init__(self, case: Case, dtype: torch.dtype, route: str = "reverse") -> None:
        self.config, self.names = case.config, case.names
        cast = _cast(case.params, dtype)
        self.params = {n: cast[n] for n in self.names}
        self.constants = {k: v for k, v in cast.items() if k not in self.params}
        self.X, self.target = _cast(case.X, dtype), _cast(case.target, dtype)
        self.route = route

    def _each(self, function):
        """``vmap(function)`` over the samples; ``function(*arrays, constants)`` gets each
        sample's constants as a dict."""
        return lambda *arrays: vmap(function)(*arrays, self.constants)

    def _outer(self, f):
        if self.route == "reverse":
            return jacrev(jacrev(f))
        return hessian(f)

    def _flat_variables(self, x):
        return torch.cat([*(self.params[n].reshape(-1) for n in self.names), x.reshape(-1)])

    def _unflatten(self, flat):
        sizes = [self.params[n].numel() for n in self.names] + [self.X[0].numel()]
        parts = torch.split(flat, sizes)
        params = {n: p.reshape(self.params[n].shape) for n, p in zip(self.names, parts)}
        return params, parts[-1].reshape(self.X.shape[1:])

    def forward(self):
        return self._each(lambda x, c: reference_output(self.config, {**self.params, **c}, x))(
            self.X)

    def loss(self):
        return self._batch_loss(self.params)

    def _batch_loss(self, params):
        def one(x, t, c):
            return reference_loss(self.config, reference_output(self.config, {**params, **c}, x),
                                  t)
        return self._each(one)(self.X, self.target).mean()

    def jacobians(self) -> dict[str, torch.Tensor]:
        """``wrt -> (B, L·d, n_wrt)`` for every variable."""
        def sample(x, c):
            def out(flat):
                params, xx = self._unflatten(flat)
                return reference_output(self.config, {**params, **c}, xx).reshape(-1)
            return jacrev(out)(self._flat_variables(x))
        J = self._each(sample)(self.X)
        return dict(zip([*self.names, "X"], torch.split(J, self._sizes(), dim=-1)))

    def _sizes(self):
        return [self.params[n].numel() for n in self.names] + [self.X[0].numel()]

    def output_hessians(self) -> dict[tuple[str, str], torch.Tensor]:
        """``(v, w) -> (B, L·d·n_v, n_w)`` (the paper's layout) for every pair."""
        def sample(x, c):
            def out(flat):
                params, xx = self._unflatten(flat)
                return reference_output(self.config, {**params, **c}, xx).reshape(-1)
            flat = self._flat_variables(x)
            if self.route == "reverse":
                return jacrev(jacrev(out), chunk_size=OUTPUT_HESSIAN_CHUNK)(flat)
            return hessian(out)(flat)
        H = self._each(sample)(self.X)                    # B × n_out × n × n
        names, sizes = [*self.names, "X"], self._sizes()
        rows = torch.split(H, sizes, dim=2)
        result = {}
        for v, row in zip(names, rows):
            for w, block in zip(names, torch.split(row, sizes, dim=3)):
                result[v, w] = block.reshape(block.shape[0], -1, block.shape[-1])
        return result

    def loss_hessian_params(self) -> torch.Tensor:
        flat0 = torch.cat([self.params[n].reshape(-1) for n in self.names])
        sizes = [self.params[n].numel() for n in self.names]

        def flat_loss(flat):
            params = {n: p.reshape(self.params[n].shape)
                      for n, p in zip(self.names, torch.split(flat, sizes))}
            return self._batch_loss(params)
        return self._outer(flat_loss)(flat0)

    def loss_hessian_X(self) -> torch.Tensor:
        def one(x, t, c):
            return reference_loss(self.config,
                                  reference_output(self.config, {**self.params, **c}, x), t)
        H = self._each(self._outer(one))(self.X, self.target)
        n = self.X[0].numel()
        return H.reshape(-1, n, n)

    def gauss_newton(self, jacobians: dict, wrt: str) -> torch.Tensor:
        """``mean_b J_b^T (∂²ℓ/∂Z²) J_b`` (per sample for ``wrt == "X"``)."""
        J = jacobians["X"] if wrt == "X" else torch.cat([jacobians[n] for n in self.names], -1)
        Z = self.forward()
        n = Z[0].numel()
        Hz = vmap(lambda z, t: jacrev(jacrev(lambda zz: reference_loss(self.config, zz, t)))(z))(
            Z, self.target).reshape(-1, n, n)
        if wrt == "X":
            return torch.einsum("bri,brs,bsj->bij", J, Hz, J)
        return torch.einsum("bri,brs,bsj->ij", J, Hz, J) / self.X.shape[0]

    def all(self, loss_only: bool = False) -> dict[str, torch.Tensor]:
        """Every contract function's result, keyed as in :func:`curvgap_results` (with
        ``loss_only``: the loss, its Hessians and HVPs alone)."""
        J = self.jacobians()
        results = {"forward": self.forward(), "loss": self.loss()}
        if not loss_only:
            results |= {f"jacobian[{v}]": value for v, value in J.items()}
            results |= {f"output_hessian[{v},{w}]": value
                        for (v, w), value in self.output_hessians().items()}
        for label in (["params"] if self.names else []) + ["X"]:
            full = self.loss_hessian_params() if label == "params" else self.loss_hessian_X()
            gn = self.gauss_newton(J, "X" if label == "X" else "params")
            results[f"loss_hessian[{label}]"] = full
            results[f"loss_hessian[{label}].gauss_newton"] = gn
            results[f"loss_hessian[{label}].functional"] = full - gn
        return results


def directions(case: Case, results: dict) -> dict[str, torch.Tensor]:
    """Fixed float64 HVP directions, one per ``wrt`` label."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    if case.names:
        n = results["loss_hessian[params]"].shape[0]
        out["params"] = torch.randn(n, generator=gen, dtype=torch.float64)
    out["X"] = torch.randn(case.X.shape[0], case.X[0].numel(), generator=gen,
                           dtype=torch.float64)
    return out


def with_hvps(results: dict, dirs: dict) -> dict:
    """``results`` with ``hvp[label]`` from the dense loss Hessians."""
    out = dict(results)
    for label, v in dirs.items():
        H = results[f"loss_hessian[{label}]"]
        v = v.to(H.dtype)
        out[f"hvp[{label}]"] = H @ v if label == "params" else torch.einsum("bij,bj->bi", H, v)
    return out


def curvgap_results(module: ModuleType, backend: str, case: Case, dtype: torch.dtype,
                    dirs: dict, loss_only: bool = False) -> dict[str, np.ndarray]:
    """Every contract function of ``module`` on ``case`` cast to ``dtype``."""
    conv = (lambda t: t.numpy()) if backend == "numpy" else (lambda t: t)
    P = {k: conv(v) for k, v in _cast(case.params, dtype).items()}
    X, T = conv(_cast(case.X, dtype)), conv(_cast(case.target, dtype))
    variables = [*case.names, "X"]
    out = {"forward": module.forward(P, X), "loss": module.loss(P, X, T)}
    for v in [] if loss_only else variables:
        out[f"jacobian[{v}]"] = module.jacobian(P, X, v)
        for w in variables:
            out[f"output_hessian[{v},{w}]"] = module.output_hessian(P, X, v, w)
    for label in (["params"] if case.names else []) + ["X"]:
        wrt = None if label == "params" else "X"
        for part in ("full", "gauss_newton", "functional"):
            key = f"loss_hessian[{label}]" + ("" if part == "full" else f".{part}")
            out[key] = module.loss_hessian(P, X, T, wrt=wrt, part=part)
        out[f"hvp[{label}]"] = module.hvp(P, X, T, conv(dirs[label].to(dtype)), wrt=wrt)
    return {k: np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                          dtype=np.float64) for k, v in out.items()}


def error(value, reference: torch.Tensor, scale: torch.Tensor) -> float:
    value = torch.as_tensor(np.asarray(value, dtype=np.float64))
    reference = reference.detach().to(torch.float64)
    size = float(scale.detach().abs().max())
    if not reference.numel():
        return 0.0
    diff = float((value.reshape(reference.shape) - reference).abs().max())
    if not np.isfinite(diff):
        return float("inf")
    return diff / size if size > 0 else diff


@dataclass
class Row:
    """One function of one case: curvgap's errors per backend, autograd's, and the bound."""

    function: str
    dtype: torch.dtype
    autograd: float
    curvgap: dict[str, float]

    @property
    def bound(self) -> float:
        return bound(self.dtype, self.autograd)

    @property
    def ratio(self) -> float:
        """curvgap's worst error over autograd's (with autograd's floored at the floor/10)."""
        return max(self.curvgap.values()) / max(self.autograd, FLOOR[self.dtype] / 10)

    @property
    def ok(self) -> bool:
        return all(e <= self.bound for e in self.curvgap.values())


def scales_for(results: dict) -> dict[str, torch.Tensor]:
    """The array each function's error is measured against: the whole quantity it is a block
    of (all Jacobians, all output-Hessian blocks, the whole loss Hessian), so that a block
    that is zero in exact arithmetic is not measured against its own rounding."""
    def largest(prefix):
        arrays = [v for k, v in results.items() if k.startswith(prefix) and v.numel()]
        return largest_entry(arrays) if arrays else None

    jacobians, output_hessians = largest("jacobian["), largest("output_hessian[")
    out = {}
    for key, value in results.items():
        if key.startswith("jacobian["):
            out[key] = jacobians
        elif key.startswith("output_hessian["):
            out[key] = output_hessians
        elif key.startswith("loss_hessian[") and "." in key:
            out[key] = results[key.rsplit(".", 1)[0]]
        else:
            out[key] = value
    return out


def measure(name: str, config: Config, scaled: str, scale: float,
            backends=("numpy", "torch"), dtypes=DTYPES,
            modules: dict[str, ModuleType] | None = None, dims: dict[str, int] = DIMS,
            batch: int = BATCH, loss_only: bool = False) -> list[Row]:
    """The rows of the stability matrix for one config and one scaled input (the shipped
    generated modules of ``name``, or ``modules`` by backend)."""
    if modules is None:
        modules = {b: importlib.import_module(f"curvgap.generated.{b}.{name}")
                   for b in backends}
    case = make_case(config, modules[backends[0]], scaled, scale, dims=dims, batch=batch)
    dirs = directions(case, Autograd(case, torch.float64).all(loss_only=True))
    rows = []
    for dtype in dtypes:
        # the reference is computed on the inputs as rounded to ``dtype``: the errors measured
        # are those of the arithmetic, not of representing the inputs
        rounded = _rounded(case, dtype)
        dirs_rounded = {k: v.to(dtype).to(torch.float64) for k, v in dirs.items()}
        reference = with_hvps(Autograd(rounded, torch.float64).all(loss_only), dirs_rounded)
        scale_of = scales_for(reference)
        route = "forward" if dtype == torch.float64 else "reverse"
        autograd = with_hvps(Autograd(case, dtype, route).all(loss_only), dirs_rounded)
        ours = {b: curvgap_results(m, b, case, dtype, dirs, loss_only)
                for b, m in modules.items()}
        for key, ref in reference.items():
            rows.append(Row(key, dtype, error(autograd[key], ref, scale_of[key]),
                            {b: error(ours[b][key], ref, scale_of[key]) for b in backends}))
        loss = next(row for row in rows if row.function == "loss" and row.dtype == dtype)
        for seed in range(1, LOSS_DRAWS):
            drawn = make_case(config, modules[backends[0]], scaled, scale, seed, dims, batch)
            _worst_of(loss, _loss_errors(drawn, dtype, modules))
    return rows


def _loss_errors(case: Case, dtype: torch.dtype,
                 modules: dict[str, ModuleType]) -> tuple[float, dict[str, float]]:
    """Autograd's error and each backend's in the loss of ``case`` in ``dtype``."""
    reference = Autograd(_rounded(case, dtype), torch.float64).loss()
    autograd = error(Autograd(case, dtype).loss(), reference, reference)
    ours = {}
    for backend, module in modules.items():
        conv = (lambda t: t.numpy()) if backend == "numpy" else (lambda t: t)
        value = module.loss({k: conv(v) for k, v in _cast(case.params, dtype).items()},
                            conv(_cast(case.X, dtype)), conv(_cast(case.target, dtype)))
        ours[backend] = error(value, reference, reference)
    return autograd, ours


def _worst_of(row: Row, errors: tuple[float, dict[str, float]]) -> None:
    """``row`` with each of its errors raised to the one in ``errors`` where that is larger."""
    autograd, ours = errors
    row.autograd = max(row.autograd, autograd)
    row.curvgap = {b: max(e, ours[b]) for b, e in row.curvgap.items()}


def _rounded(case: Case, dtype: torch.dtype) -> Case:
    """``case`` with every value rounded to ``dtype`` (and held in float64)."""
    def round_trip(value):
        return _cast(_cast(value, dtype), torch.float64)
    return Case(case.config, case.names, round_trip(case.params), round_trip(case.X),
                round_trip(case.target))
