"""The paper's printed LayerNorm formulas (Theorem 2 and App. B.2-B.3), built with explicit Kronecker and commutation matrices at a
tiny size and compared with the generated code. Where a printed formula is wrong, the test
shows the counterexample recorded in docs/ERRATA.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import commutation

from curvgap.generated.numpy import layernorm

L, d = 2, 3



def vec_r(A: np.ndarray) -> np.ndarray:
    return A.reshape(-1, 1)


@pytest.fixture
def X() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(L, d))


def printed_pieces(X):
    """M, sigma, P, dM/dX and dP/dX exactly as printed (Theorem 2, App. B.2)."""
    one = np.ones((d, 1))
    M = X - X @ one @ one.T / d
    sigma = np.sqrt((M ** 2) @ one).reshape(-1) / np.sqrt(d)
    D = np.diag(sigma)
    P = np.linalg.inv(D)
    dM = np.eye(L * d) - np.kron(np.eye(L), np.ones((d, d))) / d
    E = np.stack([np.kron(e, e) for e in np.eye(L)], axis=1)          # L² × L
    A2 = np.diag(1 / np.sqrt(((M ** 2) @ one).reshape(-1)))
    J = np.kron(np.eye(L), one.T)
    dsigma = A2 @ J @ np.diag(vec_r(M).reshape(-1)) @ dM / np.sqrt(d)
    dP = np.kron(-P, P.T) @ E @ dsigma                                  # (−D⁻¹ ⊗ D⁻ᵀ) E ∂σ/∂X
    return M, P, dM, dP, E, A2, J


def test_theorem_2_jacobian_as_printed(X):
    M, P, dM, dP, *_ = printed_pieces(X)
    G = np.eye(L * d) - np.kron(np.eye(L), np.ones((d, d))) / d
    printed = np.kron(P, np.eye(d)) @ G + np.kron(np.eye(L), M.T) @ dP
    generated = layernorm.jacobian({}, X, "X")
    assert np.abs(printed - generated).max() < 1e-12 * np.abs(generated).max()


def _numeric_jacobian(f, X, h=1e-6):
    columns = []
    for k in range(X.size):
        e = np.zeros(X.size)
        e[k] = h
        columns.append((f(X + e.reshape(X.shape)) - f(X - e.reshape(X.shape))).reshape(-1) / (2 * h))
    return np.stack(columns, axis=1)


def test_derivative_of_P_kron_I_needs_K_dL_not_K_LL(X):
    """App. B.3 prints ∂(P⊗I)/∂X = (I_L⊗K_{L,L}⊗I_L)(I_{L²}⊗vec_r I_L) ∂P/∂X: its shape only
    fits when L = d. The Kronecker rule of the matrix-calculus appendix gives (I_L⊗K_{d,L}⊗I_d)(I_{L²}⊗vec_r I_d)."""
    M, P, dM, dP, *_ = printed_pieces(X)
    printed = np.kron(np.kron(np.eye(L), commutation(L, L)), np.eye(L)) \
        @ np.kron(np.eye(L * L), vec_r(np.eye(L)))
    assert printed.shape[0] != (L * d) ** 2          # the printed factor has the wrong size
    corrected = np.kron(np.kron(np.eye(L), commutation(d, L)), np.eye(d)) \
        @ np.kron(np.eye(L * L), vec_r(np.eye(d))) @ dP

    def P_kron_I(Y):
        _, P_Y, *_ = printed_pieces(Y)
        return np.kron(P_Y, np.eye(d))

    numeric = _numeric_jacobian(P_kron_I, X)
    assert np.abs(corrected - numeric).max() < 1e-7 * np.abs(numeric).max()


def test_derivative_of_D_drops_the_1_over_sqrt_d(X):
    """App. B.3 prints ∂D/∂X = E(A_2 (I_L⊗1ᵀ) diag(vec_r M) ∂M/∂X), "as computed for the first
    derivative"; the first derivative (App. B.2) carries 1/sqrt(d), and so must this."""
    M, P, dM, dP, E, A2, J = printed_pieces(X)
    printed = E @ (A2 @ J @ np.diag(vec_r(M).reshape(-1)) @ dM)

    def D_of(Y):
        _, P_Y, *_ = printed_pieces(Y)
        return np.linalg.inv(P_Y)

    numeric = _numeric_jacobian(D_of, X)
    assert np.abs(printed / np.sqrt(d) - numeric).max() < 1e-7 * np.abs(numeric).max()
    assert np.abs(printed - numeric).max() > 0.1 * np.abs(numeric).max()


def test_generated_hessian_agrees_with_autograd_where_theorem_3_is_incomplete(X):
    """Theorem 3 leaves ∂A_2/∂X unstated; the engine's Hessian stands on its own proofs
    (tests/test_sympy_proofs.py) and agrees with autograd of the forward definition."""
    def ln(x):
        c = x - x.mean(-1, keepdim=True)
        return c / torch.sqrt((c * c).mean(-1, keepdim=True))

    H = torch.func.hessian(ln)(torch.as_tensor(X)).reshape(L * d * L * d, L * d).numpy()
    generated = layernorm.output_hessian({}, X, "X", "X")
    assert np.abs(H - generated).max() < 1e-10 * np.abs(H).max()


# -- Theorem 3's pieces (App. B.3), one at a time ---------------------------------------------
def named_factors(X):
    """The proof's named factors as functions of ``X`` (``L×d``), as dense matrices:
    ``∂P/∂X = (1/√d) A_1 B_1`` (``L² × Ld``), ``A_1 = −D⁻¹ ⊗ D⁻ᵀ`` (``L² × L²``),
    ``B_1 = E A_2 B_2`` (``L² × Ld``), ``B_2 = J A_3 B_3`` (``L × Ld``),
    ``A_3 = diag(vec_r M)`` (``Ld × Ld``), ``B_3 = ∂M/∂X`` (``Ld × Ld``), with
    ``E = (e_i ⊗ e_i)_i``, ``A_2``, ``J = I_L ⊗ 1ᵀ`` as in :func:`printed_pieces`."""
    M, P, dM, dP, E, A2, J = printed_pieces(X)
    A3 = np.diag(vec_r(M).reshape(-1))
    B2 = J @ A3 @ dM
    return {"A1": np.kron(-P, P.T), "A2": A2, "A3": A3, "B1": E @ A2 @ B2, "B2": B2,
            "dP": dP, "E": E, "J": J, "dM": dM, "M": M, "P": P}


def _derivative(name, X):
    return _numeric_jacobian(lambda Y: named_factors(Y)[name], X)


def test_the_factors_compose_to_the_printed_dP(X):
    f = named_factors(X)
    assert np.abs(f["A1"] @ f["B1"] / np.sqrt(d) - f["dP"]).max() < 1e-13 * np.abs(f["dP"]).max()


def test_dA_3_sums_over_L_d_diagonal_entries_not_L(X):
    """App. B.3 prints ``∂A_3/∂X = (e_1⊗e_1, …, e_L⊗e_L) I_{Ld} ∂M/∂X`` with ``e_i ∈ R^{Ld}``:
    ``A_3 = diag(vec_r M)`` is ``Ld × Ld``, so the diagonal map needs all ``L·d`` columns
    ``e_i⊗e_i``; with ``L`` of them the factor has ``L`` columns against ``I_{Ld}``'s
    ``L·d`` rows. With ``L·d`` columns it is right."""
    f, n = named_factors(X), L * d
    printed = np.stack([np.kron(e, e) for e in np.eye(n)[:L]], axis=1)
    assert printed.shape[1] != n
    full = np.stack([np.kron(e, e) for e in np.eye(n)], axis=1)
    numeric = _derivative("A3", X)
    assert np.abs(full @ f["dM"] - numeric).max() < 1e-7 * np.abs(numeric).max()


def test_dB_2_agrees(X):
    """``∂B_2/∂X = (J⊗I_{Ld})((A_3⊗I_{Ld}) ∂B_3/∂X + (I_{Ld}⊗B_3ᵀ) ∂A_3/∂X)``, ``∂B_3/∂X = 0``
    (with ``∂A_3/∂X`` over all ``L·d`` diagonal entries)."""
    f, n = named_factors(X), L * d
    dA3 = np.stack([np.kron(e, e) for e in np.eye(n)], axis=1) @ f["dM"]
    printed = np.kron(f["J"], np.eye(n)) @ np.kron(np.eye(n), f["dM"].T) @ dA3
    numeric = _derivative("B2", X)
    assert np.abs(printed - numeric).max() < 1e-7 * np.abs(numeric).max()


def test_dB_1_agrees_given_the_unstated_dA_2(X):
    """``∂B_1/∂X = (E⊗I_{Ld})((A_2⊗I_{Ld}) ∂B_2/∂X + (I_L⊗B_2ᵀ) ∂A_2/∂X)``: right, with
    ``∂A_2/∂X`` (which the paper leaves unstated) taken by finite differences."""
    f, n = named_factors(X), L * d
    printed = np.kron(f["E"], np.eye(n)) @ (np.kron(f["A2"], np.eye(n)) @ _derivative("B2", X)
                                           + np.kron(np.eye(L), f["B2"].T) @ _derivative("A2", X))
    numeric = _derivative("B1", X)
    assert np.abs(printed - numeric).max() < 1e-7 * np.abs(numeric).max()


def test_dA_1_is_right_once_dD_has_its_1_over_sqrt_d(X):
    """``∂A_1/∂X = (I_L⊗K_{L,L}⊗I_L)((I_{L²}⊗vec_r D⁻ᵀ) ∂(−D⁻¹)/∂X + (vec_r(−D⁻¹)⊗I_{L²})
    ∂D⁻ᵀ/∂X)`` with ``∂(−D⁻¹)/∂X = (D⁻¹⊗D⁻ᵀ) ∂D/∂X``, ``∂D⁻ᵀ/∂X = K_{L,L}(−D⁻¹⊗D⁻ᵀ) ∂D/∂X``:
    the assembly is right; it inherits the printed ``∂D/∂X``'s missing ``1/√d``."""
    f = named_factors(X)
    P = f["P"]
    numeric = _derivative("A1", X)
    printed_dD = f["E"] @ (f["A2"] @ f["J"] @ np.diag(vec_r(f["M"]).reshape(-1)) @ f["dM"])

    def dA1(dD):
        return np.kron(np.kron(np.eye(L), commutation(L, L)), np.eye(L)) @ (
            np.kron(np.eye(L * L), vec_r(P.T)) @ np.kron(P, P.T) @ dD
            + np.kron(vec_r(-P), np.eye(L * L)) @ commutation(L, L) @ np.kron(-P, P.T) @ dD)

    assert np.abs(dA1(printed_dD / np.sqrt(d)) - numeric).max() < 1e-7 * np.abs(numeric).max()
    assert np.abs(dA1(printed_dD) - numeric).max() > 0.1 * np.abs(numeric).max()


def test_d2P_needs_the_1_over_sqrt_d_on_both_terms(X):
    """App. B.3 prints ``∂²P/∂X² = (1/√d)(A_1⊗I_{Ld}) ∂B_1/∂X + (I_{L²}⊗B_1ᵀ) ∂A_1/∂X``: the
    product rule on ``(1/√d) A_1 B_1`` puts ``1/√d`` on both terms; as printed (second term
    without it) the Hessian of ``P`` is wrong. Exact pieces by finite differences."""
    f, n = named_factors(X), L * d
    first = np.kron(f["A1"], np.eye(n)) @ _derivative("B1", X)
    second = np.kron(np.eye(L * L), f["B1"].T) @ _derivative("A1", X)
    numeric = _derivative("dP", X)
    assert np.abs((first + second) / np.sqrt(d) - numeric).max() < 1e-6 * np.abs(numeric).max()
    assert np.abs(first / np.sqrt(d) + second - numeric).max() > 0.1 * np.abs(numeric).max()
