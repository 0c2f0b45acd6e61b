"""Self-attention against Ormaniec et al.'s closed forms as the paper transcribes them,
built with explicit Kronecker and commutation matrices at a tiny size, and the engine's own
symbolic form of the V–V block."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import commutation

from curvgap.derivations.config import validate
from curvgap.derivations.indexform import Delta
from curvgap.derivations.model import derive
from curvgap.generated.numpy import self_attention as attention

L, d, d_k = 3, 4, 2



@pytest.fixture
def case():
    rng = np.random.default_rng(11)
    X = rng.normal(size=(1, L, d))
    params = {"W_Q": rng.normal(size=(d, d_k)), "W_K": rng.normal(size=(d, d_k)),
              "W_V": rng.normal(size=(d, d))}
    target = rng.normal(size=(1, L, d))
    return params, X, target


def softmax_pieces(params, X):
    T = X @ params["W_Q"] @ params["W_K"].T @ X.T / np.sqrt(d_k)
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    dA = np.zeros((L * L, L * L))                       # blockdiag_i(diag(A_i) - A_i A_i^T)
    for i in range(L):
        dA[i * L:(i + 1) * L, i * L:(i + 1) * L] = np.diag(A[i]) - np.outer(A[i], A[i])
    Z1 = np.kron(np.eye(L), X.T) @ dA @ np.kron(X, X)
    return A, Z1


def block(params, X, target, first, second, part):
    wrt = [first, second] if first != second else [first]
    H = attention.loss_hessian(params, X, target, wrt=wrt, part=part)
    n = params[first].size
    return H[:n, n:] if first != second else H[:n, :n]


def test_gauss_newton_VV_is_M1tM1_kron_I(case):
    params, X, target = case
    A, _ = softmax_pieces(params, X[0])
    M1 = A @ X[0]
    printed = 2 / (L * d) * np.kron(M1.T @ M1, np.eye(d))
    mine = block(params, X, target, "W_V", "W_V", "gauss_newton")
    assert np.abs(mine - printed).max() <= 1e-12 * np.abs(printed).max()


def test_functional_VV_is_zero(case):
    params, X, target = case
    assert np.abs(block(params, X, target, "W_V", "W_V", "functional")).max() == 0.0


@pytest.mark.parametrize("first, second", [("W_Q", "W_Q"), ("W_V", "W_Q"), ("W_Q", "W_K")])
def test_printed_gauss_newton_blocks(case, first, second):
    params, X, target = case
    W_Q, W_K, W_V = params["W_Q"], params["W_K"], params["W_V"]
    A, Z1 = softmax_pieces(params, X[0])
    M1 = A @ X[0]
    middle = Z1.T @ np.kron(np.eye(L), W_V @ W_V.T) @ Z1
    if (first, second) == ("W_Q", "W_Q"):
        printed = 2 / (L * d * d_k) * np.kron(np.eye(d), W_K.T) @ middle @ np.kron(np.eye(d), W_K)
    elif (first, second) == ("W_V", "W_Q"):
        printed = 2 / (L * d * np.sqrt(d_k)) * np.kron(M1.T, W_V.T) @ Z1 @ np.kron(np.eye(d), W_K)
    else:
        printed = (2 / (L * d * d_k) * np.kron(np.eye(d), W_K.T) @ middle
                   @ np.kron(W_Q, np.eye(d)) @ commutation(d_k, d))
    mine = block(params, X, target, first, second, "gauss_newton")
    assert np.abs(mine - printed).max() <= 1e-12 * np.abs(printed).max()


def test_engine_shows_the_kronecker_structure_of_the_VV_block():
    """Symbolically: the Gauss–Newton V–V block is the single term
    ``2/(L d) · δ[q, q'] · Σ_i G[i, p] G[i, p']`` with ``G`` a named tensor holding ``A X``,
    i.e. ``2/(L d) · (M_1^T M_1 ⊗ I_d)``; the functional V–V block is empty."""
    der = derive(validate({"name": "a", "kind": "self_attention"}))
    assign = next(a for a in der.graph.assigns if a.target.name == "gauss_newton_W_V_W_V")
    (term,) = assign.expr.terms
    p, q, p2, q2 = assign.target.indices
    assert Delta(q, q2) in term.factors or Delta(q2, q) in term.factors
    G1, G2 = term.data_factors
    assert G1.name == G2.name and G1.indices[0] == G2.indices[0]   # Σ_i G[i, p] G[i, p']
    assert {G1.indices[-1], G2.indices[-1]} == {p, p2}
    M1 = next(a for a in der.graph.assigns if a.target.name == G1.name)
    (m1_term,) = M1.expr.terms                                      # G = A X, the paper's M_1
    assert sorted(f.name for f in m1_term.data_factors) == ["A", "X"]
    L_, d_ = sp.symbols("L d", positive=True, integer=True)
    assert term.coeff == 2 / (L_ * d_)
    functional = next(a for a in der.graph.assigns if a.target.name == "functional_W_V_W_V")
    assert functional.expr.is_zero
