"""Self-attention against Ormaniec et al.'s closed forms as the paper transcribes them,
built with explicit Kronecker and commutation matrices at a tiny size, and the engine's own
symbolic form of the V–V block."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
import torch
from conftest import commutation

from curvgap.analysis import bounds
from curvgap.derivations.config import validate
from curvgap.derivations.derivation import derive
from curvgap.derivations.indexform import Delta
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
    return A, dA, Z1


def block(params, X, target, first, second, part):
    wrt = [first, second] if first != second else [first]
    H = attention.loss_hessian(params, X, target, wrt=wrt, part=part)
    n = params[first].size
    return H[:n, n:] if first != second else H[:n, :n]


def test_gauss_newton_VV_is_M1tM1_kron_I(case):
    params, X, target = case
    A, _, _ = softmax_pieces(params, X[0])
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
    A, _, Z1 = softmax_pieces(params, X[0])
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


# -- the printed objects of App. B.1, B.4 and the Φ lemma (App. C), as printed ---------------
def vec_r(A: np.ndarray) -> np.ndarray:
    return A.reshape(-1, 1)


def softmax_second_derivative(T: np.ndarray) -> np.ndarray:
    """``∂²A/∂T²`` of the row softmax by reverse-over-reverse autograd, paper layout
    ``(L²·L²) × L²``: entry ``[a·L² + t, t']`` is ``∂²vec_r(A)_a/∂vec_r(T)_t∂vec_r(T)_t'``."""
    n = T.shape[0]

    def softmax(t):
        return torch.softmax(t.reshape(n, n), -1).reshape(-1)

    t = torch.tensor(T.reshape(-1))
    second = torch.autograd.functional.jacobian(
        lambda s: torch.autograd.functional.jacobian(softmax, s, create_graph=True).reshape(-1),
        t)
    return second.numpy().reshape(n ** 4, n ** 2)


def printed_objects(params, X, target):
    """``A``, ``∂A/∂T``, ``Z_1``, ``Z_2``, ``S``, ``R_m`` exactly as printed (App. B.1)."""
    W_Q, W_K, W_V = params["W_Q"], params["W_K"], params["W_V"]
    X = X[0]
    A, dA, Z1 = softmax_pieces(params, X)
    T = X @ W_Q @ W_K.T @ X.T / np.sqrt(d_k)
    Z2 = (np.kron(np.eye(L), np.kron(X.T, np.kron(X.T, X.T))) @ softmax_second_derivative(T)
          @ np.kron(X, X))
    S = np.kron(np.eye(d), commutation(d, d)) @ np.kron(vec_r(np.eye(d)), np.eye(d))
    residual = A @ X @ W_V - target[0]

    def R(m):
        return np.kron(vec_r(residual).T, np.eye(m))

    return {"A": A, "dA": dA, "Z1": Z1, "Z2": Z2, "S": S, "R": R, "X": X}


def test_lemma_C1_softmax_hessian_rows_as_printed():
    """Row ``i`` of ``∂²A_ij/∂T_i,:∂T_i,:`` is ``A_ij(2 a aᵀ + E_jj − diag a − e_j aᵀ − a e_jᵀ)``,
    ``a = A_i,:`` (App. B.1, step 5), and nothing couples different rows."""
    T = np.random.default_rng(2).normal(size=(L, L)) * 2
    second = softmax_second_derivative(T).reshape(L, L, L, L, L, L)  # [i, j, i', k, i'', k']
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    for i in range(L):
        a = A[i]
        for j in range(L):
            e = np.eye(L)[j]
            printed = A[i, j] * (2 * np.outer(a, a) + np.outer(e, e) - np.diag(a)
                                 - np.outer(e, a) - np.outer(a, e))
            assert np.abs(second[i, j, i, :, i, :] - printed).max() < 1e-14
            others = np.delete(np.delete(second[i, j], i, axis=0), i, axis=2)
            assert not others.any()


@pytest.mark.parametrize("scale", [0.0, 1.0, 4.0, 30.0])
def test_softmax_hessian_norm_is_not_the_max_of_its_blocks_but_is_far_below_6(scale):
    """Step 5 says ``‖∂²A/∂T²‖ = max_ij ‖∂²A_ij/∂T_i,:²‖ ≤ 6``. In the paper's layout the
    blocks of one row ``i`` are stacked, so the norm is ``max_i ‖[C_i1; …; C_iL]‖`` and can
    exceed the largest block (uniform attention: 0.192 against 0.111); ``≤ 6`` holds with
    room (the largest found by search over ``T`` is about 0.272, docs/ERRATA.md)."""
    T = scale * np.random.default_rng(4).normal(size=(L, L))
    second = softmax_second_derivative(T)
    blocks = second.reshape(L, L, L, L, L, L)
    largest_block = max(np.linalg.norm(blocks[i, j, i, :, i, :], 2)
                        for i in range(L) for j in range(L))
    norm = np.linalg.norm(second, 2)
    stacked = max(np.linalg.norm(blocks[i, :, i, :, i, :].reshape(L * L, L), 2)
                  for i in range(L))
    assert abs(norm - stacked) < 1e-12 * max(norm, 1e-300)
    assert norm <= 6
    if scale == 0.0:
        assert norm > 1.3 * largest_block


def test_Z_2_as_printed_and_its_bound(case):
    """``Z_2 = (I_L⊗Xᵀ⊗Xᵀ⊗Xᵀ) ∂²A/∂T² (X⊗X)`` chains, ``(L·d³) × d²``, and
    ``‖Z_2‖ ≤ 6‖X‖⁵`` (step 5) holds."""
    params, X, target = case
    Z2 = printed_objects(params, X, target)["Z2"]
    assert Z2.shape == (L * d ** 3, d ** 2)
    assert np.linalg.norm(Z2, 2) <= 6 * np.linalg.norm(X[0], 2) ** 5


def test_S_is_d_cubed_by_d_not_d_squared_by_d(case):
    """App. B.1 and the Φ lemma state ``S = (I_d⊗K_{d,d})(vec_r I_d ⊗ I_d) ∈ R^{d²×d}``; its
    factors make it ``d³ × d``, which is the shape ``H_f(V,Q)`` needs."""
    S = printed_objects(*case)["S"]
    assert S.shape == (d ** 3, d) != (d ** 2, d)


def test_R_m_carries_the_loss_gradient_up_to_2_over_L_d(case):
    """``R_m = vec_r(F − T)ᵀ ⊗ I_m`` (``m × m·L·d``): the functional block is
    ``H_f(W_i, W_j) = (2/(L d)) R_{n_i} Φ_ij`` for the loss ``‖F − T‖_F²/(L d)`` with the
    engine's ``Φ_ij = ∂²F/∂W_i∂W_j``, and ``‖R_m‖ = ‖F − T‖_F ≤ √rank ‖F − T‖₂`` (step 4)."""
    params, X, target = case
    objects = printed_objects(params, X, target)
    residual = (attention.forward(params, X) - target)[0]
    for first, second in (("W_Q", "W_Q"), ("W_V", "W_Q"), ("W_Q", "W_K"), ("W_K", "W_V")):
        R = objects["R"](params[first].size)
        assert R.shape == (params[first].size, params[first].size * L * d)
        Phi = attention.output_hessian(params, X[0], first, second)
        mine = block(params, X, target, first, second, "functional")
        assert np.abs(2 / (L * d) * R @ Phi - mine).max() <= 1e-12 * np.abs(mine).max()
    R = objects["R"](3)
    frobenius = np.linalg.norm(residual)
    assert abs(np.linalg.norm(R, 2) - frobenius) <= 1e-12 * frobenius
    rank = np.linalg.matrix_rank(residual)
    assert frobenius <= np.sqrt(rank) * np.linalg.norm(residual, 2) * (1 + 1e-12)


def _printed_phi(name, params, objects):
    """The Φ lemma's ``Φ_QQ``, ``Φ_VQ`` and the first (``Z_2``) term of ``Φ_QK``, as printed
    (``(L·d·n_i) × n_j``)."""
    W_Q, W_K, W_V = params["W_Q"], params["W_K"], params["W_V"]
    outer = np.kron(np.eye(L), np.kron(W_V.T, np.kron(np.eye(d), W_K.T)))
    if name == "QQ":
        return 2 / (L * d * d_k) * outer @ objects["Z2"] @ np.kron(np.eye(d), W_K)
    if name == "VQ":
        return (2 / (L * d * np.sqrt(d_k)) * np.kron(np.eye(L), objects["S"]) @ objects["Z1"]
                @ np.kron(np.eye(d), W_K))
    return (2 / (L * d * d_k) * outer @ objects["Z2"] @ np.kron(W_Q, np.eye(d))
            @ commutation(d_k, d))


def _printed_functional(name, params, objects):
    """``H_f(Q,Q)``, ``H_f(V,Q)`` and the first term of ``H_f(Q,K)`` as printed: App. B.1
    prints each as ``R_{n_i}`` times the Φ lemma's block (``n_i × n_j``)."""
    first = {"QQ": "W_Q", "VQ": "W_V", "QK": "W_Q"}[name]
    return objects["R"](params[first].size) @ _printed_phi(name, params, objects)


@pytest.mark.parametrize("first, second, name", [("W_Q", "W_Q", "QQ"), ("W_V", "W_Q", "VQ")])
def test_printed_functional_blocks_QQ_and_VQ_agree(case, first, second, name):
    """``H_f(Q,Q)`` and ``H_f(V,Q)`` as printed (``S`` taken at its real size ``d³ × d``)
    equal the engine's functional blocks."""
    params, X, target = case
    printed = _printed_functional(name, params, printed_objects(params, X, target))
    mine = block(params, X, target, first, second, "functional")
    assert np.abs(printed - mine).max() <= 1e-12 * np.abs(mine).max()


def test_printed_functional_QK_agrees_with_S_kron_I_applied_last(case):
    """``H_f(Q,K)`` as printed, its second term
    ``(2/(L d √d_k)) R_d (I_L⊗W_Vᵀ⊗I_d)(Z_1⊗I_d) S ⊗ I_{d_k}`` read as ``(… S) ⊗ I_{d_k}``,
    equals the engine's block; read as ``(…)(S ⊗ I_{d_k})`` it does not chain
    (``d³`` columns against ``d³ d_k`` rows)."""
    params, X, target = case
    objects = printed_objects(params, X, target)
    Z1, S, R = objects["Z1"], objects["S"], objects["R"]
    head = R(d) @ np.kron(np.eye(L), np.kron(params["W_V"].T, np.eye(d))) @ np.kron(Z1, np.eye(d))
    assert head.shape[1] != np.kron(S, np.eye(d_k)).shape[0]
    second = 2 / (L * d * np.sqrt(d_k)) * np.kron(head @ S, np.eye(d_k))
    printed = _printed_functional("QK", params, objects) + second
    mine = block(params, X, target, "W_Q", "W_K", "functional")
    assert np.abs(printed - mine).max() <= 1e-12 * np.abs(mine).max()
    assert np.abs(second).max() > 0.1 * np.abs(mine).max()      # both terms matter


@pytest.mark.parametrize("first, second, name", [("W_Q", "W_Q", "QQ"), ("W_V", "W_Q", "VQ")])
def test_printed_phi_is_the_second_derivative_times_the_loss_factor(case, first, second, name):
    """The Φ lemma defines ``Φ_ij := ∂²F/∂W_i∂W_j`` but prints ``Φ_QQ``, ``Φ_VQ`` with the
    MSE's ``2/(L d)`` kept from ``H_f``: as printed they are ``2/(L d)`` times the engine's
    ``∂²F/∂W_i∂W_j``, not equal to it."""
    params, X, target = case
    printed = _printed_phi(name, params, printed_objects(params, X, target))
    mine = attention.output_hessian(params, X[0], first, second)
    assert printed.shape == mine.shape
    assert np.abs(printed - 2 / (L * d) * mine).max() <= 1e-12 * np.abs(mine).max()
    assert np.abs(printed - mine).max() > 0.5 * np.abs(mine).max()


def test_printed_phi_QK_second_term_does_not_chain(case):
    """``Φ_QK``'s second term ``(2/(L d √d_k))(I_d⊗W_Vᵀ⊗I_d)(Z_1⊗I_d) S⊗I_{d_k}``: the first
    factor has ``d³`` columns, ``Z_1⊗I_d`` has ``L d²`` rows (equal only when ``L = d``);
    with ``I_L`` for the first ``I_d`` and without ``2/(L d)`` it is the term below.
    Its first term is, like ``Φ_QQ``, ``2/(L d)`` times the ``Z_2`` part of ``∂²F``: the
    engine's ``Φ_QK`` is ``(L d/2)`` times that term plus the derivative of ``X⊗XW_K`` in
    ``G_Q`` with ``∂A/∂T`` held, ``((I_L⊗W_VᵀXᵀ) ∂A/∂T ⊗ I_{n_Q})(I_L⊗K_{L,d}⊗I_{d_k})
    (vec_r X ⊗ I_{L d_k})(X ⊗ I_{d_k})/√d_k`` (the Kronecker rule)."""
    params, X, target = case
    objects = printed_objects(params, X, target)
    left = np.kron(np.eye(d), np.kron(params["W_V"].T, np.eye(d)))
    assert left.shape[1] != np.kron(objects["Z1"], np.eye(d)).shape[0]
    Xs, n_q = objects["X"], d * d_k
    held = (np.kron(np.kron(np.eye(L), params["W_V"].T @ Xs.T) @ objects["dA"], np.eye(n_q))
            @ np.kron(np.kron(np.eye(L), commutation(L, d)), np.eye(d_k))
            @ np.kron(vec_r(Xs), np.eye(L * d_k)) @ np.kron(Xs, np.eye(d_k))) / np.sqrt(d_k)
    mine = attention.output_hessian(params, Xs, "W_Q", "W_K")
    first = _printed_phi("QK", params, objects)
    assert np.abs(L * d / 2 * first + held - mine).max() <= 1e-12 * np.abs(mine).max()
    assert np.abs(first - mine).max() > 0.5 * np.abs(mine).max()
    # with I_L for I_d (as H_f(Q,K) prints it) and without 2/(L d), the second term is right
    with_I_L = np.kron(np.kron(np.eye(L), np.kron(params["W_V"].T, np.eye(d)))
                       @ np.kron(objects["Z1"], np.eye(d)) @ objects["S"], np.eye(d_k))
    assert np.abs(with_I_L / np.sqrt(d_k) - held).max() <= 1e-12 * np.abs(held).max()


def test_printed_G_V_G_Q_agree_and_G_K_needs_K_dk_d(case):
    """App. B.4 (Noci et al.): ``G_V = A X ⊗ I_d`` and
    ``G_Q = (I_L⊗W_VᵀXᵀ) ∂A/∂T (X ⊗ X W_K)/√d_k`` equal the engine's Jacobians;
    ``G_K = (I_L⊗W_VᵀXᵀ) ∂A/∂T ((X W_Q ⊗ X) K_{d_V d_K})/√d_k`` is wrong with
    ``K_{d_V,d_K}`` (``d ≠ d_k``) and right with ``K_{d_K,d_V}``, as ``H_o(Q,K)`` prints it."""
    params, X, target = case
    W_Q, W_K, W_V = params["W_Q"], params["W_K"], params["W_V"]
    objects = printed_objects(params, X, target)
    A, dA, Xs = objects["A"], objects["dA"], objects["X"]
    front = np.kron(np.eye(L), W_V.T @ Xs.T) @ dA / np.sqrt(d_k)
    printed = {"W_V": np.kron(A @ Xs, np.eye(d)), "W_Q": front @ np.kron(Xs, Xs @ W_K),
               "W_K": front @ np.kron(Xs @ W_Q, Xs) @ commutation(d, d_k)}
    mine = {name: attention.jacobian(params, Xs, name) for name in printed}
    for name in ("W_V", "W_Q"):
        assert np.abs(printed[name] - mine[name]).max() <= 1e-12 * np.abs(mine[name]).max()
    assert np.abs(printed["W_K"] - mine["W_K"]).max() > 0.1 * np.abs(mine["W_K"]).max()
    repaired = front @ np.kron(Xs @ W_Q, Xs) @ commutation(d_k, d)
    assert np.abs(repaired - mine["W_K"]).max() <= 1e-12 * np.abs(mine["W_K"]).max()


def test_step_3_3_vanishing_claims_fail_at_exactly_uniform_attention():
    """Step 3.3: with uniform attention ``∂A/∂M = (1/L) I_L⊗(I_L − 1 1ᵀ/L)`` is constant, and
    the paper concludes ``Φ_VV = Φ_VQ = Φ_VK = Φ_QQ = Φ_KK = 0``. At exactly uniform
    attention (``W_Q W_Kᵀ = 0`` with both weights nonzero, so ``T = 0``) the softmax
    Jacobian is that constant, ``Φ_VV = 0``, but ``Φ_VQ, Φ_VK, Φ_QQ, Φ_KK`` are not zero:
    ``A`` still moves with ``W_Q``, ``W_K`` (``∂A/∂T ≠ 0``), and ``∂²A/∂T² ≠ 0`` at ``T = 0``.
    The engine's ``Φ`` here agree with reverse-over-reverse autograd of ``F``."""
    rng = np.random.default_rng(8)
    q, k = rng.integers(-3, 4, size=(d, 1)) / 4, rng.integers(-3, 4, size=(d, 1)) / 4
    params = {"W_Q": np.hstack([q, -q]), "W_K": np.hstack([k, k]),
              "W_V": rng.normal(size=(d, d))}
    X = rng.integers(-3, 4, size=(L, d)) / 2          # dyadic: T = 0 without rounding
    T = X @ params["W_Q"] @ params["W_K"].T @ X.T / np.sqrt(d_k)
    assert not T.any()
    _, dA, _ = softmax_pieces(params, X)
    uniform = np.kron(np.eye(L), np.eye(L) - np.ones((L, L)) / L) / L
    assert np.abs(dA - uniform).max() < 1e-15

    def F(W_Q, W_K, W_V):
        Xt = torch.tensor(X)
        return torch.softmax(Xt @ W_Q @ W_K.T @ Xt.T / np.sqrt(d_k), -1) @ Xt @ W_V

    weights = tuple(torch.tensor(params[n]) for n in ("W_Q", "W_K", "W_V"))
    position = {"W_Q": 0, "W_K": 1, "W_V": 2}
    for first, second in (("W_V", "W_V"), ("W_V", "W_Q"), ("W_V", "W_K"), ("W_Q", "W_Q"),
                          ("W_K", "W_K")):
        mine = attention.output_hessian(params, X, first, second)
        n1, n2 = params[first].size, params[second].size

        def G(*w, first=first):
            jac = torch.autograd.functional.jacobian(F, w, create_graph=True)
            return jac[position[first]].reshape(-1)

        full = torch.autograd.functional.jacobian(G, weights)[position[second]]
        reference = full.reshape(L * d * n1, n2).numpy()
        assert np.abs(mine - reference).max() <= 1e-12 * max(np.abs(reference).max(), 1.0)
        if first == second == "W_V":
            assert not mine.any()
        else:
            assert np.linalg.norm(mine, 2) > 1e-2 * np.linalg.norm(X, 2) ** 2


def test_the_analysis_takes_Z_1_and_the_softmax_hessian_in_the_papers_layout(case):
    """``analysis.bounds.attention_steps`` measures ``‖Z_1‖`` and ``‖∂²A/∂T²‖`` of the
    printed objects: equal to the norms of ``Z_1`` built with Kronecker products and of the
    full autograd second derivative."""
    params, X, target = case
    objects = printed_objects(params, X, target)
    torch_params = {k: torch.tensor(v) for k, v in params.items()}
    found = {c.quantity: c.true for c in bounds.attention_steps(torch_params,
                                                                torch.tensor(X[0]))}
    T = X[0] @ params["W_Q"] @ params["W_K"].T @ X[0].T / np.sqrt(d_k)
    for quantity, printed in (("‖Z_1‖ ≤ ‖X‖³/L", objects["Z1"]),
                              ("‖∂²A/∂T²‖ ≤ 6", softmax_second_derivative(T))):
        norm = np.linalg.norm(printed, 2)
        assert abs(found[quantity] - norm) <= 1e-12 * norm
