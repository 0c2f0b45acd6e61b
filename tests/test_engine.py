"""Unit checks of the index-form algebra: delta elimination, sums, binding."""

from __future__ import annotations

import sympy as sp

from curvgap.derivations import calculus
from curvgap.derivations.graph import Graph, delta
from curvgap.derivations.indexform import Delta, Ref, Term, simplify_term

n, m = sp.symbols("n m", positive=True, integer=True)


def test_delta_with_summed_index_is_eliminated_by_substitution():
    g = Graph()
    i, j, k = g.index(n), g.index(n), g.index(m)
    term = Term(sp.Integer(2), (Ref("A", (i, k)), Delta(i, j)))
    simplified = simplify_term(term, (j, k))
    assert simplified.factors == (Ref("A", (j, k)),)
    assert simplified.coeff == 2


def test_delta_between_free_indices_is_kept():
    g = Graph()
    i, j = g.index(n), g.index(n)
    term = Term(sp.Integer(1), (Delta(i, j),))
    assert simplify_term(term, (i, j)).factors == (Delta(i, j),)


def test_trace_of_delta_is_the_dimension():
    g = Graph()
    i = g.index(n)
    assert simplify_term(Term(sp.Integer(1), (Delta(i, i),)), ()).coeff == n


def test_sum_of_a_constant_counts_the_values():
    """d/dB of sum_ij B_j is n (B broadcast over the rows i): the lost summed index counts."""
    g = Graph()
    i, j = g.index(n), g.index(m)
    b = g.input("b", (m,), role="param", batched=False)
    rows = g.node("rows", (i, j), b[j])
    g.node("total", (), rows[i, j])
    tangents = calculus.propagate(g, g.assigns, calculus.seed(g, b), "b")
    (term,) = tangents.by_name["total"].terms
    assert term.coeff == n and not term.data_factors


def test_bind_factors_out_common_deltas():
    g = Graph()
    i, j, p = g.index(n), g.index(m), g.index(n)
    A = g.input("A", (n, m))
    expr = (A[i, j] * delta(i, p) + 2 * A[i, j] * A[i, j] * delta(i, p)).with_free((i, j, p))
    bound = g.bind("K", expr)
    assert g.tensors["K"].indices == (i, j)
    (term,) = bound.terms
    assert Delta(i, p) in term.factors


def test_a_product_no_order_keeps_within_the_memory_limit_still_gets_a_pairwise_order():
    """GPT-2 block's diagonal: dynamic programming finds no order under the limit (opt_einsum
    raises); the order of fewest flops is taken instead."""
    from curvgap.codegen.lowering import _path

    shapes = ((8, 128, 32), (8, 128, 32), (32,), (8, 4, 128, 8), (8, 4, 128, 8), (8, 128))
    path, flops = _path("acd,ace,e,afcg,ahci,ac->fgdhi", shapes, (4, 8, 32, 4, 8))
    assert all(len(step) == 2 for step in path) and len(path) == 5 and flops > 0
