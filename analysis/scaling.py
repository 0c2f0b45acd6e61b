"""How each loss-Hessian block scales with the input: ``X → σX``, weights and target fixed.

Symbolic: the *degree* of a tensor is its valuation as ``σ → 0``, the lowest power of ``σ``
among its terms, read off the engine's index-form definitions (``der.graph.assigns``):

* the input ``X`` has degree 1; parameters and the target 0;
* a term's degree is the sum of its factors' (a product), an expression's the minimum
  over its terms (a sum; no cancellation between terms is assumed);
* ``f(u)`` for an elementwise ``f`` and ``u`` of degree ``k``: order one when ``k = 0``;
  otherwise ``|k|`` times the exponent of the leading term of ``f(±t)`` as ``t → 0⁺``
  (``k > 0``) or of ``f(±1/t)`` (``k < 0``), the smaller over the two signs. So
  ``u^p ↦ p·k``, ``(u + eps)^p ↦ 0`` for ``eps > 0``, ``exp(u), ReLU'(u) ↦ 0``,
  ``ReLU(u) ↦ k``;
* the row maximum that shifts the softmax argument is a constant of its argument's degree.

Numeric: ``‖block‖_F`` of the generated ``loss_hessian`` (Gauss–Newton and functional
parts) at several small ``σ``; the slope of ``log ‖block‖_F`` against ``log σ``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import sympy as sp
import torch

from ..codegen.resources import shipped_configs
from ..derivations.config import load
from ..derivations.derivation import Derivation, derive
from ..derivations.functions import ScalarFn, x
from ..derivations.indexform import Apply, Delta, Expr, Ref

Degree = sp.Rational | None  # None: the tensor is identically zero
PARTS = ("gauss_newton", "functional")
_t = sp.Symbol("t", positive=True)


@cache
def function_degree(fn: ScalarFn, k: sp.Rational) -> Degree:
    """The degree of ``fn(u)`` for ``u`` of degree ``k`` (see the module docstring)."""
    if k == 0:
        return sp.Integer(0)
    degrees = []
    for sign in (1, -1):
        value = sp.simplify(fn.expr.subs(x, sign * _t if k > 0 else sign / _t))
        if value == 0:
            continue
        _, exponent = value.as_leading_term(_t).as_coeff_exponent(_t)
        degrees.append(sp.Rational(exponent) * abs(k))
    return min(degrees) if degrees else None


class DegreeWalk:
    """Degrees of the named tensors of one derivation, each from its definition."""

    def __init__(self, der: Derivation) -> None:
        self.graph = der.graph
        self.definitions = {a.target.name: a for a in der.graph.assigns}
        self.known: dict[str, Degree] = {}

    def tensor(self, name: str) -> Degree:
        """The degree of the named tensor ``name``."""
        if name in self.known:
            return self.known[name]
        assign = self.definitions.get(name)
        if assign is None:
            role = self.graph.tensors[name].role
            if role not in ("input", "param", "target"):
                raise ValueError(f"name: expected an assigned tensor, an input, a parameter "
                                 f"or the target, got {name!r} of role {role!r}")
            degree = sp.Integer(1) if role == "input" else sp.Integer(0)
        elif assign.reduction == "causal":
            degree = sp.Integer(0)          # 0 or −inf whatever σ is
        else:
            degree = self.expr(assign.expr)
        self.known[name] = degree
        return degree

    def factor(self, factor: Ref | Apply | Delta) -> Degree:
        if isinstance(factor, Delta):
            return sp.Integer(0)
        inner = self.tensor(factor.name)
        if isinstance(factor, Ref) or inner is None:
            return inner
        return function_degree(factor.fn, inner)

    def expr(self, expr: Expr) -> Degree:
        """``min`` over terms of the sum of the factors' degrees; ``None`` when zero."""
        degrees = []
        for term in expr.terms:
            parts = [self.factor(f) for f in term.factors]
            if None not in parts:
                degrees.append(sum(parts, sp.Integer(0)))
        return min(degrees) if degrees else None


def shipped(name: str):
    """The shipped config ``name``."""
    return load(next(p for p in shipped_configs() if p.stem == name))


def block_degrees(name: str) -> dict[tuple[str, str, str], Degree]:
    """``{(v, w, part): degree}`` of every loss-Hessian block ``(v, w)`` (``v`` before
    ``w`` in parameter order) of the shipped config ``name``, ``part`` ``"gauss_newton"``
    or ``"functional"``."""
    der = derive(shipped(name))
    walk = DegreeWalk(der)
    params = [p.name for p in der.params]
    blocks = der.nodes("loss_hessian", ("gauss_newton", "functional"))
    return {(v, w, part): walk.tensor(output) for (v, w, part), output in blocks.items()
            if v in params and w in params}


@dataclass
class Sweep:
    """``‖block‖_F`` of each part at each ``σ`` for one generated module."""

    sigmas: np.ndarray
    norms: dict[tuple[str, str, str], np.ndarray]


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"curvgap.generated.torch.{name}")


def sweep(name: str, dims: dict[str, int], sigmas: np.ndarray, batch: int = 2,
          seed: int = 0) -> Sweep:
    """Frobenius norms of the loss-Hessian blocks of ``name`` at inputs ``σX`` (``X``,
    weights ``~ N(0, 1/d)`` and target ``~ N(0, 1)`` fixed by ``seed``), float64."""
    module = _module(name)
    gen = torch.Generator().manual_seed(seed)
    params = {p: torch.randn(*(dims[s] for s in shape), generator=gen, dtype=torch.float64)
              / dims["d"] ** 0.5 for p, shape in module.PARAMS}
    X = torch.randn(batch, dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    target = torch.randn(batch, dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    names = [p for p, _ in module.PARAMS]
    offsets = np.cumsum([0] + [params[p].numel() for p in names])
    norms: dict[tuple[str, str, str], list[float]] = {}
    for sigma in sigmas:
        for part in PARTS:
            H = module.loss_hessian(params, sigma * X, target, part=part)
            for a, v in enumerate(names):
                for b in range(a, len(names)):
                    block = H[offsets[a]:offsets[a + 1], offsets[b]:offsets[b + 1]]
                    norms.setdefault((v, names[b], part), []).append(
                        float(torch.linalg.matrix_norm(block)))
    return Sweep(np.asarray(sigmas), {k: np.asarray(v) for k, v in norms.items()})


def fitted_exponent(sigmas: np.ndarray, norms: np.ndarray) -> float | None:
    """The least-squares slope of ``log ‖block‖_F`` against ``log σ``; ``None`` when the
    block is zero at every ``σ``."""
    if not np.all(norms > 0):
        if np.all(norms == 0):
            return None
        raise ValueError("norms: expected all zero or all positive, got a mix")
    return float(np.polyfit(np.log(sigmas), np.log(norms), 1)[0])


#: ``(block, part)`` curves drawn in the figure, when the config has the parameters.
FIGURE_CURVES = (("W_V", "W_V", "gauss_newton"), ("W_V", "W_V", "functional"),
                 ("W_Q", "W_Q", "gauss_newton"), ("W_Q", "W_Q", "functional"),
                 ("W_Q", "W_V", "gauss_newton"), ("W_1", "W_1", "gauss_newton"))


def short(block: tuple[str, str, str]) -> str:
    """``"V–V GN"`` for ``("W_V", "W_V", "gauss_newton")``."""
    v, w, part = block
    return f"{v[2:]}–{w[2:]} {'GN' if part == 'gauss_newton' else 'func.'}"


def plot_scaling(sweeps: dict[str, Sweep], fit_below: dict[str, float],
                 degrees: dict[str, dict], path: Path) -> None:
    """``‖block‖_F`` against ``σ`` on log–log axes, one panel per config, the fit range
    shaded, each curve labelled with its derived degree and fitted slope."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(6.4 * len(sweeps), 7.2))
    for ax, (name, data) in zip(np.atleast_1d(axes), sweeps.items()):
        low = data.sigmas <= fit_below[name]
        ax.axvspan(data.sigmas.min(), fit_below[name], color="0.92")
        for block in FIGURE_CURVES:
            norms = data.norms.get(block)
            if norms is None or not np.all(norms > 0):
                continue
            slope = fitted_exponent(data.sigmas[low], norms[low])
            ax.plot(data.sigmas, norms, marker=".",
                    label=f"{short(block)}: derived {degrees[name][block]}, fit {slope:.2f}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("input scale σ  (X → σX)")
        ax.set_ylabel("‖block‖_F")
        ax.set_title(f"{name} (shaded: fit range)", fontsize=12)
        ax.legend(fontsize=9.5, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1,
                  frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=115)
    plt.close(fig)
