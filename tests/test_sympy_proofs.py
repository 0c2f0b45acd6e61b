"""SymPy proofs: the engine's derived rules equal SymPy's derivatives of the forward
definitions, exactly, at every size from 2 to 5.

The engine's expressions are read by the direct evaluator (:mod:`derivations.evaluate`,
no code generation involved) on symbolic inputs; SymPy differentiates an independent
transcription of the forward formula; every entry of the difference must simplify to 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from curvgap.derivations import sizes
from curvgap.derivations.config import validate
from curvgap.derivations.derivation import derive
from curvgap.derivations.evaluate import evaluate
from curvgap.derivations.functions import power, x
from curvgap.derivations.sizes import B


def normalized_rows(X: np.ndarray, norm: str, eps, gamma=None, beta=None) -> list:
    """The forward definition, transcribed independently (row-major entries)."""
    L, d = X.shape
    out = []
    for i in range(L):
        row = list(X[i])
        if norm == "layernorm":
            mu = sum(row) / d
            centred = [e - mu for e in row]
            scale = sp.sqrt(sum(c * c for c in centred) / d + eps)
        else:
            centred = row
            scale = sp.sqrt(sum(c * c for c in row) / d + eps)
        for j, c in enumerate(centred):
            value = c / scale
            if gamma is not None:
                value = value * gamma[j]
            if beta is not None:
                value = value + beta[j]
            out.append(value)
    return out


def derived(options: dict, L: int, d: int, groups: tuple[str, ...]):
    der = derive(validate({"name": "proof", "kind": "layernorm", **options}))
    X = np.array(sp.symbols(f"x0:{L * d}", real=True)).reshape(L, d)
    values = {"X": X}
    if options.get("affine"):
        values["gamma"] = np.array(sp.symbols(f"g0:{d}", real=True))
        if options.get("norm", "layernorm") == "layernorm":
            values["beta"] = np.array(sp.symbols(f"b0:{d}", real=True))
    assigns = [a for a in der.graph.assigns if a.group in ("forward", *groups)]
    return evaluate(der.graph, assigns, values, {sizes.L: L, sizes.d: d, B: 1})


def assert_zero(difference) -> None:
    bad = [e for e in np.asarray(difference, dtype=object).reshape(-1) if sp.simplify(e) != 0]
    assert not bad, f"{len(bad)} entries differ, e.g. {bad[0]}"


def test_rsqrt_rule_is_sympys_derivative():
    eps = sp.Rational(1, 100000)
    fn = power(sp.Rational(-1, 2), eps)
    assert sp.simplify(fn.diff().expr - (-sp.Rational(1, 2)) * (x + eps) ** sp.Rational(-3, 2)) == 0
    assert sp.simplify(fn.diff().diff().expr - sp.diff(fn.expr, x, 2)) == 0


VARIANTS = {
    "layernorm": {"eps": 0.0},
    "layernorm_affine": {"eps": 1e-5, "affine": True},
    "rmsnorm": {"norm": "rmsnorm", "eps": 0.0},
    "rmsnorm_affine": {"norm": "rmsnorm", "eps": 1e-5, "affine": True},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("L, d", [(1, 2), (1, 3), (1, 4), (1, 5), (2, 2), (2, 3)])
def test_jacobians_equal_sympy(variant, L, d):
    options = VARIANTS[variant]
    wrt = ["X"] + (["gamma"] if options.get("affine") else []) \
        + (["beta"] if options.get("affine") and "norm" not in options else [])
    values = derived(options, L, d, tuple(f"{g}_{v}" for v in wrt for g in ("tangent", "jacobian")))
    eps = sp.nsimplify(options["eps"])
    Z = normalized_rows(values["X"], options.get("norm", "layernorm"), eps,
                        values.get("gamma"), values.get("beta"))
    for v in wrt:
        reference = sp.Matrix(Z).jacobian(sp.Matrix(values[v].reshape(-1)))
        mine = values[f"jacobian_{v}"].reshape(reference.shape)
        assert_zero(np.array(reference) - mine)


@pytest.mark.parametrize("variant, L, d", [
    ("layernorm", 1, 2), ("layernorm", 1, 3),
    pytest.param("layernorm", 1, 4, marks=pytest.mark.slow),  # 14 s of symbolic algebra
    pytest.param("layernorm", 1, 5, marks=pytest.mark.slow),  # 40 s
    ("layernorm", 2, 2), pytest.param("layernorm", 2, 3, marks=pytest.mark.slow),  # 14 s
    ("layernorm_affine", 1, 2), pytest.param("layernorm_affine", 1, 3,
                                             marks=pytest.mark.slow),  # 11 s
    ("rmsnorm", 1, 3), ("rmsnorm_affine", 1, 2)])
def test_output_hessians_equal_sympy(variant, L, d):
    options = VARIANTS[variant]
    pairs = [("X", "X")] + ([("gamma", "X")] if options.get("affine") else [])
    groups = ("tangent_X", "tangent_gamma", *(f"second_{v}_{w}" for v, w in pairs))
    values = derived(options, L, d, groups)
    eps = sp.nsimplify(options["eps"])
    Z = normalized_rows(values["X"], options.get("norm", "layernorm"), eps,
                        values.get("gamma"), values.get("beta"))
    for v, w in pairs:
        first, second = values[v].reshape(-1), values[w].reshape(-1)
        mine = values[f"output_hessian_{v}_{w}"].reshape(len(Z), len(first), len(second))
        reference = [[[sp.diff(z, a, b) for b in second] for a in first] for z in Z]
        assert_zero(np.array(reference, dtype=object) - mine)


@pytest.mark.parametrize("d", [2, pytest.param(3, marks=pytest.mark.slow)])   # d = 3: 12 s
def test_loss_hessian_parts_equal_sympy(d):
    """Gauss–Newton and functional parts of the MSE loss Hessian in X (one row)."""
    der = derive(validate({"name": "proof", "kind": "layernorm", "eps": 0.0}))
    X = np.array(sp.symbols(f"x0:{d}", real=True)).reshape(1, d)
    T = np.array(sp.symbols(f"t0:{d}", real=True)).reshape(1, d)
    groups = ("forward", "loss", "tangent_X", "loss_tangent_X", "adjoints", "loss_hessian_X_X")
    values = evaluate(der.graph, [a for a in der.graph.assigns if a.group in groups],
                      {"X": X, "T": T}, {sizes.L: 1, sizes.d: d, B: 1})
    Z = normalized_rows(X, "layernorm", 0)
    xs, ts = list(X.reshape(-1)), list(T.reshape(-1))
    loss = sum((z - t) ** 2 for z, t in zip(Z, ts)) / d
    full = sp.hessian(loss, xs)
    J = sp.Matrix(Z).jacobian(sp.Matrix(xs))
    gauss_newton = J.T * (sp.Rational(2, d) * sp.eye(d)) * J
    assert_zero(np.array(gauss_newton) - values["gauss_newton_X_X"].reshape(d, d))
    assert_zero(np.array(full - gauss_newton) - values["functional_X_X"].reshape(d, d))


def _softmax_graph():
    """The engine's row softmax alone, with its Jacobian and second derivative in T."""
    from curvgap.derivations import calculus
    from curvgap.derivations.graph import Graph
    from curvgap.derivations.softmax import softmax_rows

    g = Graph()
    T = g.input("T", (sizes.L, sizes.d))
    A = softmax_rows(g, T)
    forward = list(g.assigns)
    first = calculus.propagate(g, forward, calculus.seed(g, T), "T")
    g.output("jacobian", first.by_name["A"])
    renamed = {i: g.index(i.dim, "q") for i in first.indices}
    both = calculus.propagate_second(g, forward, first, first, renamed, "TT")
    g.output("hessian", both.by_name["A"])
    return g, A


@pytest.mark.parametrize("rows, n", [(1, 2), pytest.param(1, 3, marks=pytest.mark.slow),
                                     pytest.param(1, 4, marks=pytest.mark.slow), (1, 5),
                                     pytest.param(2, 3, marks=pytest.mark.slow)])
# (1, 3): 10 s, (1, 4): 12 s, (2, 3): 13 s
def test_row_softmax_rules_equal_sympy(rows, n):
    g, A = _softmax_graph()
    T = np.array(sp.symbols(f"t0:{rows * n}", real=True)).reshape(rows, n)
    values = evaluate(g, g.assigns, {"T": T, "T_max": np.zeros(rows, dtype=object)},
                      {sizes.L: rows, sizes.d: n, B: 1})
    reference = []
    for i in range(rows):
        total = sum(sp.exp(t) for t in T[i])
        reference += [sp.exp(t) / total for t in T[i]]
    ts = list(T.reshape(-1))
    assert_zero(np.array(sp.Matrix(reference).jacobian(sp.Matrix(ts)))
                - values["jacobian"].reshape(rows * n, rows * n))
    if n <= 4:
        hessian = [[[sp.diff(a, u, v) for v in ts] for u in ts] for a in reference]
        assert_zero(np.array(hessian, dtype=object)
                    - values["hessian"].reshape(rows * n, rows * n, rows * n))


def _rule_graph(primitive: str):
    """``ell = Σ C ∘ A²`` for ``A = softmax(T)``, or ``ell = Σ_i lse_i²`` for the row
    log-sum-exp: every rule of the primitive (tangent, adjoint, loss-Hessian part,
    forward-over-adjoint) enters its gradient, Hessian and Hessian-vector product."""
    from curvgap.derivations import calculus
    from curvgap.derivations.graph import Graph
    from curvgap.derivations.indexform import Expr, Term
    from curvgap.derivations.softmax import log_sum_exp_rows, softmax_rows

    g = Graph()
    T = g.input("T", (sizes.L, sizes.d))
    C = g.input("C", (sizes.L, sizes.d), role="target")
    i, j = g.index(sizes.L), g.index(sizes.d)
    if primitive == "softmax":
        A = softmax_rows(g, T)
        ell = g.node("ell", (), C[i, j] * A[i, j] * A[i, j])
    else:
        lse = log_sum_exp_rows(g, T, prefix="ce_")
        ell = g.node("ell", (), lse[i] * lse[i])
    forward = list(g.assigns)
    adjoints = calculus.propagate_adjoints(g, forward, ell, Expr([Term(sp.Integer(1))]).with_free(()))
    program = list(g.assigns)
    first = calculus.propagate(g, forward, calculus.seed(g, T), "T")
    renamed = {k: g.index(k.dim, "q") for k in first.indices}
    g.output("gradient", adjoints["T"])
    g.output("hessian", calculus.hessian_by_adjoints(g, forward, adjoints, first, first, renamed))
    v = g.input("v_T", T.shape, role="direction")
    directions = calculus.Tangents((), {"T": v[T.indices].with_free(T.indices)})
    calculus.propagate(g, program, directions, "v")
    g.output("hvp", calculus.differentiate(g, adjoints["T"], directions))
    return g


@pytest.mark.parametrize("primitive", ["softmax", "log_sum_exp"])
@pytest.mark.parametrize("rows, n", [(1, 2), pytest.param(1, 3, marks=pytest.mark.slow),
                                     (2, 2)])  # (1, 3): 10 s
def test_primitive_adjoint_and_hessian_rules_equal_sympy(primitive, rows, n):
    g = _rule_graph(primitive)
    T = np.array(sp.symbols(f"t0:{rows * n}", real=True)).reshape(rows, n)
    C = np.array(sp.symbols(f"c0:{rows * n}", real=True)).reshape(rows, n)
    v = np.array(sp.symbols(f"v0:{rows * n}", real=True)).reshape(rows, n)
    shift = np.zeros(rows, dtype=object)
    values = evaluate(g, g.assigns, {"T": T, "C": C, "v_T": v, "T_max": shift,
                                     "ce_max": shift}, {sizes.L: rows, sizes.d: n, B: 1})
    ts = list(T.reshape(-1))
    if primitive == "softmax":
        loss = 0
        for r in range(rows):
            total = sum(sp.exp(t) for t in T[r])
            loss += sum(c * (sp.exp(t) / total) ** 2 for t, c in zip(T[r], C[r]))
    else:
        loss = sum(sp.log(sum(sp.exp(t) for t in T[r])) ** 2 for r in range(rows))
    gradient = sp.Matrix([sp.diff(loss, t) for t in ts])
    hessian = sp.hessian(loss, ts)
    assert_zero(np.array(gradient).reshape(-1) - values["gradient"].reshape(-1))
    assert_zero(np.array(hessian) - values["hessian"].reshape(rows * n, rows * n))
    assert_zero(np.array(hessian * sp.Matrix(v.reshape(-1))).reshape(-1)
                - values["hvp"].reshape(-1))
