"""Kronecker structure of a loss-Hessian block, read off its index form.

A block over two matrix parameters ``V`` (``p×q``) and ``W`` (``p'×q'``) has free indices
``(a, c, a', c')`` (``V[a, c]``, ``W[a', c']``); in the ``vec_r`` layout its entry
``[(a, c), (a', c')]`` is that of ``A ⊗ B`` when it equals ``A[a, a'] B[c, c']``. A term of the
block is such a product when its factors fall into two groups that share no summed index,
one carrying only ``a, a'`` (and summed indices) and the other only ``c, c'``, and at most one
of the two groups reads per-sample data (a batch mean of products of two per-sample factors
is a sum of Kronecker products, one per sample, not one). Scalar factors join the per-sample
group. Terms whose fixed factor (the group without per-sample data) is the same are summed
into one product, so a block is returned as the shortest sum ``Σ_k A_k ⊗ B_k`` this grouping
finds, or ``None`` when some term is not a product. A factor that is ``s·δ`` (a multiple of
the identity) is marked as the identity, its scale moved to the other factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .graph import Graph
from .indexform import Delta, Expr, Index, Term, canonical_form


@dataclass
class Product:
    """``left ⊗ right``: ``left`` over ``(a, a')``, ``right`` over ``(c, c')``; ``None`` for
    the identity."""

    left: Expr | None
    right: Expr | None


def _components(term: Term, free: set[Index]) -> list[list]:
    """The factors of ``term`` grouped by the summed indices they share."""
    groups: list[tuple[set[Index], list]] = []
    for factor in term.factors:
        summed = {i for i in factor.indices if i not in free}
        joined = [g for g in groups if g[0] & summed]
        merged = (set(summed), [factor])
        for g in joined:
            merged[0].update(g[0])
            merged[1][:0] = g[1]
            groups.remove(g)
        groups.append(merged)
    return [factors for _, factors in groups]


def _split(graph: Graph, term: Term, rows: set[Index], columns: set[Index]
           ) -> tuple[Term, Term, bool] | None:
    """``term`` as ``(left, right, left_moves)``: the factors over ``rows`` and over
    ``columns``, the coefficient and scalar factors on the per-sample side (``left_moves``:
    the left one, or neither); ``None`` if it is not a product."""
    left, right, scalar = [], [], []
    for component in _components(term, rows | columns):
        carried = {i for f in component for i in f.indices} & (rows | columns)
        if carried and carried <= rows:
            left += component
        elif carried and carried <= columns:
            right += component
        elif not carried:
            scalar += component
        else:
            return None

    def batched(factors: list) -> bool:
        return any(graph.tensors[f.name].batched for f in factors if not isinstance(f, Delta))

    if batched(left) and batched(right):
        return None
    left_moves = not batched(right)
    if left_moves:
        return Term(term.coeff, tuple(left + scalar)), Term(sp.Integer(1), tuple(right)), True
    return Term(sp.Integer(1), tuple(left)), Term(term.coeff, tuple(right + scalar)), False


def _identity_scale(expr: Expr) -> sp.Expr | None:
    """``s`` when ``expr`` is ``s·δ`` over its two free indices, else ``None``."""
    if len(expr.terms) != 1:
        return None
    term = expr.terms[0]
    if term.factors == (Delta(*expr.free),) or term.factors == (Delta(*expr.free[::-1]),):
        return term.coeff
    return None


def kronecker_products(graph: Graph, block: Expr) -> list[Product] | None:
    """``block`` (free ``(a, c, a', c')``) as a sum of Kronecker products, or ``None``."""
    a, c, a2, c2 = block.free
    rows, columns = {a, a2}, {c, c2}
    grouped: dict[tuple, tuple[list[Term], Term, bool]] = {}
    for term in block.terms:
        split = _split(graph, term, rows, columns)
        if split is None:
            return None
        left, right, left_moves = split
        fixed, free = (right, (c, c2)) if left_moves else (left, (a, a2))
        key = (left_moves, canonical_form(fixed, free)[0], sp.srepr(fixed.coeff))
        moving = left if left_moves else right
        grouped.setdefault(key, ([], fixed, left_moves))[0].append(moving)
    products = []
    for moving, fixed, left_moves in grouped.values():
        moving_free, fixed_free = ((a, a2), (c, c2)) if left_moves else ((c, c2), (a, a2))
        moved = Expr(moving, moving_free).simplified()
        kept = Expr([fixed], fixed_free).simplified()
        if moved.is_zero or kept.is_zero:
            continue
        scale = _identity_scale(kept)
        if scale is not None:  # s·I ⊗ A is I ⊗ (s·A)
            moved, kept = (moved * scale).with_free(moving_free), None
        else:
            scale = _identity_scale(moved)
            if scale is not None:
                moved, kept = None, (kept * scale).with_free(fixed_free)
        left, right = (moved, kept) if left_moves else (kept, moved)
        products.append(Product(left, right))
    return products
