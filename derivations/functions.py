"""Elementwise scalar functions and their derivatives, derived by SymPy.

A :class:`ScalarFn` is a SymPy expression in the variable :data:`x`. Its derivatives are
``sympy.diff`` of that expression, so every elementwise rule of the engine is SymPy's own.
Functions that are not differentiable everywhere (ReLU) are differentiated almost
everywhere: SymPy's ``DiracDelta`` terms, supported on a null set, are dropped, and
``Heaviside(x)`` is read as the indicator ``x > 0``.

Derivatives are kept in forms that stay accurate in floating point at large arguments:
``1 − tanh(u)²`` is written ``sech(u)²`` (the difference loses every digit once ``tanh(u)``
rounds to ±1, and ``gelu_tanh''`` multiplies it by a cubic), and the logistic function and
softplus are SymPy functions of their own (:class:`sigmoid`, :class:`softplus`), whose
derivatives stay in terms of ``σ`` and print as overflow-free calls (``exp(−x)/(1 + exp(−x))²``
is ``inf/inf`` at ``x = −100``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

x = sp.Symbol("x", real=True)


class sigmoid(sp.Function):  # noqa: N801  (a SymPy function, named as SymPy's are)
    """The logistic function ``σ(u) = 1 / (1 + exp(−u))``, ``σ'(u) = σ(u) σ(−u)`` (``σ(−u)``
    is ``1 − σ(u)`` without the cancellation)."""

    def fdiff(self, argindex: int = 1) -> sp.Expr:
        return sigmoid(self.args[0]) * sigmoid(-self.args[0])

    def _eval_rewrite_as_exp(self, arg: sp.Expr, **kwargs) -> sp.Expr:
        return 1 / (1 + sp.exp(-arg))

    def _eval_is_real(self) -> bool | None:
        return self.args[0].is_real

    def _latex(self, printer, exp: str | None = None) -> str:
        power = "" if exp is None else f"^{{{exp}}}"
        return rf"\sigma{power}\left({printer._print(self.args[0])}\right)"


class softplus(sp.Function):  # noqa: N801
    """``softplus(u) = log(1 + exp(u))``, ``softplus' = σ``."""

    def fdiff(self, argindex: int = 1) -> sp.Expr:
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, arg: sp.Expr, **kwargs) -> sp.Expr:
        return sp.log(1 + sp.exp(arg))

    def _eval_is_real(self) -> bool | None:
        return self.args[0].is_real

    def _latex(self, printer, exp: str | None = None) -> str:
        power = "" if exp is None else f"^{{{exp}}}"
        return (rf"\operatorname{{softplus}}{power}"
                rf"\left({printer._print(self.args[0])}\right)")


#: The elementwise functions every array backend prints (besides powers and arithmetic).
PRINTABLE: tuple[type, ...] = (sp.exp, sp.log, sp.tanh, sp.cosh, sp.sinh, sp.cos, sp.sin,
                               sp.tan, sp.sign, sp.erf, sp.Abs, sp.Max, sp.Heaviside, sp.sech,
                               sigmoid, softplus)


def unprintable(expr: sp.Expr) -> list[str]:
    """The names of the functions in ``expr`` that no backend prints (empty when none)."""
    found = {type(a) for a in expr.atoms(sp.Function, sp.Max, sp.Min, sp.Piecewise)}
    return sorted(f.__name__ for f in found if f not in PRINTABLE)


def stable_form(expr: sp.Expr) -> sp.Expr:
    """``expr`` with ``tanh(u)²`` written ``1 − sech(u)²``, so that ``1 − tanh(u)²`` becomes
    ``sech(u)²`` (exact where the difference would cancel)."""
    return expr.subs({t**2: 1 - sp.sech(t.args[0])**2 for t in expr.atoms(sp.tanh)})


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
        return ScalarFn(self.label + "'", stable_form(derivative))


def power(exponent: sp.Expr, shift: sp.Expr = 0, label: str = "pow") -> ScalarFn:
    """``(x + shift) ** exponent``."""
    return ScalarFn(label, (x + sp.nsimplify(shift)) ** exponent)


def exp() -> ScalarFn:
    return ScalarFn("exp", sp.exp(x))


def activation(name: str) -> ScalarFn:
    """The FFN activations a config may name, as SymPy expressions of :data:`x`."""
    expressions = {
        "relu": sp.Max(x, 0),
        "gelu": x * (1 + sp.erf(x / sp.sqrt(2))) / 2,
        "gelu_tanh": x * (1 + sp.tanh(sp.sqrt(2 / sp.pi)
                                      * (x + sp.Rational(44715, 1000000) * x**3))) / 2,
        # transformers' gelu_fast: the tanh form with its own rounded constant
        "gelu_fast": x * (1 + sp.tanh(sp.Rational(7978845608, 10**10)
                                      * x * (1 + sp.Rational(44715, 1000000) * x**2))) / 2,
        "quick_gelu": x * sigmoid(sp.Rational(1702, 1000) * x),  # CLIP's
        "silu": x * sigmoid(x),
        "tanh": sp.tanh(x),
        "sigmoid": sigmoid(x),
        "softplus": softplus(x),
        "identity": x,
    }
    return ScalarFn(name, expressions[name])


_POINTS = (-3.1, -1.3, -0.4, 0.3, 0.9, 2.2)
_NAMED = ("gelu", "gelu_tanh", "gelu_fast", "quick_gelu", "silu", "tanh", "sigmoid", "softplus")


def _values(expr: sp.Expr) -> tuple[complex, ...]:
    """``expr`` at a few points, to 30 digits (the logistic functions as exponentials)."""
    expr = expr.rewrite(sp.exp)
    return tuple(complex(expr.subs(x, p).evalf(30)) for p in _POINTS)


@functools.cache
def _named_values() -> dict[str, tuple[complex, ...]]:
    return {name: _values(activation(name).expr) for name in _NAMED}


def recognised(expr: sp.Expr) -> str | None:
    """The name of the activation of :func:`activation` that ``expr`` (of :data:`x`) is, to
    the last bits of its float constants (GPT-2's GELU written out with ``0.044715`` and
    ``sqrt(2/pi)``), else ``None``."""
    try:
        values = _values(expr)
    except (TypeError, ValueError):
        return None
    for name, reference in _named_values().items():
        if all(abs(v - r) <= 1e-13 * (1 + abs(r)) for v, r in zip(values, reference,
                                                                  strict=True)):
            return name
    return None
