"""Elementwise scalar functions and their derivatives, derived by SymPy.

A :class:`ScalarFn` is a SymPy expression in the variable :data:`x`. Its derivatives are
``sympy.diff`` of that expression, so every elementwise rule of the engine is SymPy's own.
Functions that are not differentiable everywhere (ReLU) are differentiated almost
everywhere: SymPy's ``DiracDelta`` terms, supported on a null set, are dropped, and
``Heaviside(x)`` is read as the indicator ``x > 0``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

x = sp.Symbol("x", real=True)


@dataclass(frozen=True)
class ScalarFn:
    """``expr`` as a function of :data:`x`; ``label`` names it in code and formulas."""

    label: str
    expr: sp.Expr

    @functools.cached_property
    def key(self) -> str:
        """Equal for equal functions, whatever their labels."""
        return sp.srepr(self.expr)

    def diff(self) -> ScalarFn:
        """The derivative, almost everywhere."""
        derivative = sp.diff(self.expr, x).replace(sp.DiracDelta, lambda *args: sp.S.Zero)
        return ScalarFn(self.label + "'", derivative)


def power(exponent: sp.Expr, shift: sp.Expr = 0, label: str = "pow") -> ScalarFn:
    """``(x + shift) ** exponent``."""
    return ScalarFn(label, (x + sp.nsimplify(shift)) ** exponent)


def exp() -> ScalarFn:
    return ScalarFn("exp", sp.exp(x))


def activation(name: str) -> ScalarFn:
    """The FFN activations of DESIGN.md §5 as SymPy expressions of :data:`x`."""
    expressions = {
        "relu": sp.Max(x, 0),
        "gelu": x * (1 + sp.erf(x / sp.sqrt(2))) / 2,
        "gelu_tanh": x * (1 + sp.tanh(sp.sqrt(2 / sp.pi)
                                      * (x + sp.Rational(44715, 1000000) * x**3))) / 2,
        "silu": x / (1 + sp.exp(-x)),
        "tanh": sp.tanh(x),
        "sigmoid": 1 / (1 + sp.exp(-x)),
        "softplus": sp.log(1 + sp.exp(x)),
        "identity": x,
    }
    return ScalarFn(name, expressions[name])
