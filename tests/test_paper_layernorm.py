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
    """M, sigma, P, dM/dX and dP/dX exactly as printed (§3.2, §7.2)."""
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
    """§7.3 prints ∂(P⊗I)/∂X = (I_L⊗K_{L,L}⊗I_L)(I_{L²}⊗vec_r I_L) ∂P/∂X: its shape only
    fits when L = d. The Kronecker rule of §6 gives (I_L⊗K_{d,L}⊗I_d)(I_{L²}⊗vec_r I_d)."""
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
    """§7.3 prints ∂D/∂X = E(A_2 (I_L⊗1ᵀ) diag(vec_r M) ∂M/∂X), "as computed for the first
    derivative"; the first derivative (§7.2) carries 1/sqrt(d), and so must this."""
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
