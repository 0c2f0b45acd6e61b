"""The loss-Hessian blocks in matrix form by the Gauss–Newton decomposition, over the output
Jacobians ``J_V`` and second derivatives ``∂²Z/∂V∂W`` the derivation holds (a document
states them first and derives those in its appendix):
``H^GN_{V,W} = J_V^T (∂²ℓ/∂Z²) J_W`` and ``H^F_{V,W} = (vec_r(∂ℓ/∂Z)^T ⊗ I_{n_V}) ∂²Z/∂V∂W``,
with the loss's own derivatives in matrix form (the mean squared error, a linear loss, the
cross-entropy over rows)."""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from . import matrixform as mf
from .derivation import Derivation
from .indexform import Index, Ref

Leaf = Callable[[str, int], "mf.MatLeaf | None"]


def decomposed_forms(der: Derivation) -> dict[str, mf.MatExpr]:
    """The loss-Hessian blocks as the Gauss–Newton decomposition states them, in matrix form
    over the output Jacobians ``J_V`` and second derivatives ``∂²Z/∂V∂W``, for the blocks
    whose contracted form no rule turns into a matrix: ``H^GN_{V,W} = J_V^T (∂²ℓ/∂Z²) J_W``
    and ``H^F_{V,W} = (vec_r(∂ℓ/∂Z)^T ⊗ I_{n_V}) ∂²Z/∂V∂W`` (:func:`_loss_derivatives`)."""
    assigns = {a.target.name: a for a in der.graph.assigns}
    Z = der.output

    def leaf(name: str, rows: int) -> mf.MatLeaf | None:
        """The tensor ``name`` with its first ``rows`` indices as rows, the rest columns."""
        assign = assigns.get(name)
        if assign is None:
            return None
        indices = assign.target.indices
        return mf.MatLeaf(Ref(name, indices), tuple(range(rows)),
                          tuple(range(rows, len(indices))))

    curvature, adjoint = _loss_derivatives(der, leaf)
    forms: dict[str, mf.MatExpr] = {}
    for v, w in der.nodes("loss_hessian"):
        J_v, J_w = leaf(f"jacobian_{v}", len(Z.shape)), leaf(f"jacobian_{w}", len(Z.shape))
        if J_v is not None and J_w is not None and curvature is not None:
            forms[f"gauss_newton_{v}_{w}"] = (
                mf.MatScaled(curvature, mf.MatProduct((mf.MatTranspose(J_v), J_w)))
                if isinstance(curvature, sp.Expr)
                else mf.MatProduct((mf.MatTranspose(J_v), curvature, J_w)))
        shape_v = der.graph.tensors[v].shape
        second = leaf(f"output_hessian_{v}_{w}", len(Z.shape) + len(shape_v))
        if second is not None and adjoint is not None:
            n_v, row = sp.Mul(*shape_v), mf.MatVec(adjoint[1], row=True)
            left = row if n_v == 1 else mf.MatKron((row, mf.MatIdentity(n_v)))
            forms[f"functional_{v}_{w}"] = mf.MatScaled(adjoint[0],
                                                        mf.MatProduct((left, second)))
    return forms


def _loss_derivatives(der: Derivation, leaf: Leaf) -> tuple[sp.Expr | mf.MatExpr | None,
                                                      tuple[sp.Expr, mf.MatExpr] | None]:
    """``∂²ℓ/∂Z²`` (a multiple of the identity as that multiple) and ``∂ℓ/∂Z`` (a scale and a
    matrix) of the loss in matrix form, where they have one: the mean squared error
    ``(2/n_Z) I`` and ``(2/n_Z) D``; a linear loss ``0``; the cross-entropy over rows with
    one-hot targets (weights ``w``: 1, or 0 where a row is ignored), ``(1/n_rows)
    (diag(vec_r(diag(w) P)) − diag(vec_r P) (diag(w) ⊗ 1 1^T) diag(vec_r P))`` and
    ``(1/n_rows) diag(w) (P − T)`` with ``P`` the rows' softmax."""
    Z, loss = der.output, der.config.loss
    if loss == "mse" and leaf("D", 1) is not None:
        n_Z = sp.Mul(*Z.shape)
        return 2 / n_Z, (2 / n_Z, leaf("D", 1))
    if loss == "linear":
        return sp.Integer(0), None
    P, weights = leaf("ce_P", len(Z.shape) - 1), leaf("ce_w", len(Z.shape) - 1)
    if loss != "cross_entropy" or P is None or weights is None:
        return None, None
    n_rows, classes = sp.Mul(*Z.shape[:-1]), Z.shape[-1]
    w = mf.MatDiag(weights)
    spread = mf.MatDiag(mf.MatVec(P))
    ones = mf.MatProduct((mf.MatOnes(classes), mf.MatTranspose(mf.MatOnes(classes))))
    curvature = mf.MatScaled(1 / n_rows, mf.MatSum((
        mf.MatDiag(mf.MatVec(mf.MatProduct((w, P)))),
        mf.MatScaled(sp.Integer(-1), mf.MatProduct((spread, mf.MatKron((w, ones)), spread))))))
    target = der.graph.tensors["T"]
    T = mf.MatLeaf(Ref("T", tuple(Index(f"_t{k}", d) for k, d in enumerate(target.shape))),
                   tuple(range(len(target.shape) - 1)), (len(target.shape) - 1,))
    return curvature, (1 / n_rows, mf.MatProduct((w, mf.MatSum((
        P, mf.MatScaled(sp.Integer(-1), T))))))
