"""Per-sample losses of the output ``Z`` (``L×d``, or any shape) as index-form nodes.

MSE: ``D_ij = Z_ij - T_ij``, ``ell = Σ_ij D_ij² / (L·d)``.
Cross-entropy: the rows of ``Z`` are logits over its last axis and ``T`` is the one-hot
target (a row of zeros where the target is ignored): ``ell = Σ_i w_i lse_j(R_ij) / rows``,
the row weights ``w_i = Σ_j T_ij`` (1, or 0 for an ignored row), the margins ``R = (1 − T) ∘
(Z − ⟨T, Z⟩)`` (``lse_i(R) = lse_i(Z) − Z_it``; ``R`` is exactly 0 at the target and carries
no derivative there) and ``lse`` the row log-sum-exp primitive of :mod:`.softmax` (computed
shifted by the row maximum; derivatives in centred form). The target's entry of the gradient
is then ``−Σ_{j≠t} p_j``, exact when the softmax saturates, where ``p_t − 1`` would round to
0.
Linear: ``ell = Σ_ij T_ij Z_ij``, the output contracted with a cotangent ``T``: its gradient
is the vector-Jacobian product ``J^T vec(T)``, its Hessian ``(vec(T)^T ⊗ I) ∂²Z`` (all
functional; the Gauss–Newton part is zero), the pieces that chain rules across layers need.
Residual losses registered with :func:`register_residual_loss`:
``ell = Σ_ij f(Z_ij - T_ij) / (L·d)`` for a SymPy expression ``f`` of the residual.
"""

from __future__ import annotations

import sympy as sp

from .functions import PRINTABLE, ScalarFn, unprintable, x
from .graph import Graph, Tensor
from .softmax import log_sum_exp_rows

#: The residual variable of user losses.
r = sp.Symbol("r", real=True)

_RESIDUAL: dict[str, sp.Expr] = {}
#: The losses every config may use without registering one.
BUILT_IN = ("mse", "cross_entropy", "linear")


def register_residual_loss(name: str, expr: sp.Expr) -> None:
    """Make ``loss = "<name>"`` mean ``mean_ij f(Z_ij - T_ij)`` with ``f = expr``, a SymPy
    expression of :data:`r` (a plain ``Symbol("r")`` is read as it), twice differentiable
    almost everywhere, and written with functions the backends print (for example
    ``log(cosh(r))``; ``Piecewise`` is refused: a Huber-like loss can be written
    ``sqrt(1 + r**2) - 1``)."""
    if not isinstance(name, str) or not name.isidentifier() or name in BUILT_IN:
        raise ValueError(f"name: expected a new identifier for the loss, got {name!r}")
    try:
        expr = sp.sympify(expr, strict=True)
    except (sp.SympifyError, TypeError):
        raise TypeError(f"expr: expected a SymPy expression of r, got {expr!r} "
                        f"({type(expr).__name__})") from None
    expr = expr.subs({s: r for s in expr.free_symbols if s.name == "r"})
    if expr.free_symbols - {r}:
        raise ValueError(f"expr: expected an expression of the residual r alone, got free "
                         f"symbols {sorted(map(str, expr.free_symbols - {r}))}")
    if r not in expr.free_symbols:
        raise ValueError(f"expr: expected an expression that depends on the residual r, got "
                         f"the constant {expr} (its derivatives are all zero)")
    fn = ScalarFn(name, expr.subs(r, x))
    for order, derived in enumerate((fn, fn.diff(), fn.diff().diff())):
        if derived.expr.has(sp.zoo, sp.oo, -sp.oo, sp.nan):
            raise ValueError(f"expr: expected a finite loss, but its derivative of order "
                             f"{order} is {derived.expr.subs(x, r)}")
        missing = unprintable(derived.expr)
        if missing:
            raise ValueError(
                f"expr: its derivative of order {order} uses {', '.join(missing)}, which the "
                "generated code does not print (it prints "
                + ", ".join(f.__name__ for f in PRINTABLE) + ", powers and arithmetic)")
    _RESIDUAL[name] = expr


def names() -> tuple[str, ...]:
    """Every loss name a config may use."""
    return (*BUILT_IN, *_RESIDUAL)


def residual_loss(name: str) -> sp.Expr:
    return _RESIDUAL[name]


def build(g: Graph, loss: str, Z: Tensor, target: Tensor) -> Tensor:
    """The nodes of ``loss`` on ``Z`` (rows over every axis but the last, which holds the
    classes of a cross-entropy) and ``target``, ending in the per-sample ``ell``."""
    idx = tuple(g.index(dim, "i" if n < len(Z.shape) - 1 else "j")
                for n, dim in enumerate(Z.shape))
    rows = idx[:-1]
    count = sp.Mul(*Z.shape)
    if loss == "mse":
        D = g.node("D", idx, Z[idx] - target[idx])
        return g.node("ell", (), (1 / count) * D[idx] * D[idx])
    if loss == "cross_entropy":
        # margins to the target's logit, R = (1 − T) ∘ (Z − ⟨T, Z⟩), so ℓ = lse(R): the
        # target's entry of every derivative is then a sum of the other classes' (exact when
        # the softmax saturates), never p_t − 1 with p_t rounded to 1
        Zt = g.node("ce_Zt", rows, target[idx] * Z[idx])
        D = g.node("ce_D", idx, Z[idx] - Zt[rows])
        R = g.node("ce_R", idx, D[idx] - target[idx] * D[idx])
        lse = log_sum_exp_rows(g, R, prefix="ce_")
        # each row weighed by its target's sum: 1, or 0 for a row whose target is ignored
        w = g.node("ce_w", rows, target[idx])
        return g.node("ell", (), (1 / sp.Mul(*Z.shape[:-1])) * w[rows] * lse[rows])
    if loss == "linear":
        return g.node("ell", (), target[idx] * Z[idx])
    D = g.node("D", idx, Z[idx] - target[idx])
    f = ScalarFn(loss, _RESIDUAL[loss].subs(r, x))
    return g.node("ell", (), (1 / count) * D.apply(f, *idx))
