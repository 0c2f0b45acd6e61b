"""Spectral and Frobenius norms of loss Hessians: dense, by block, and Lanczos on an HVP.

For a symmetric Hessian ``H`` (``n×n``), ``‖H‖₂ = max_k |λ_k(H)|``. Small ``n``: dense
``eigvalsh``. Larger ``n``: Lanczos (``scipy.sparse.linalg.eigsh``, ``which="LM"``) on the
Hessian as an operator (:func:`curvgap.operators.hessian_operator`, products through the generated
``hvp``), so ``H`` is never formed.
A rectangular block ``B`` (``n_i×n_j``) has ``‖B‖₂ = σ_max(B)``.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, eigsh

from ..operators import hessian_operator

#: Above this many parameters the Hessian's norm is taken by Lanczos, not densely.
DENSE_LIMIT = 1500


def spectral_norm(A: torch.Tensor) -> float:
    """``‖A‖₂``, the largest singular value of a matrix (``max |λ|`` when symmetric)."""
    return float(torch.linalg.matrix_norm(A, ord=2))


def symmetric_spectral_norm(H: torch.Tensor) -> float:
    """``max_k |λ_k(H)|`` of a symmetric ``H`` (``n×n``) by ``eigvalsh``."""
    return float(torch.linalg.eigvalsh(H).abs().max())


def lanczos_spectral_norm(operator: LinearOperator, seed: int = 0, tol: float = 1e-10
                          ) -> float:
    """``max_k |λ_k(H)|`` of the symmetric ``H`` (``n×n``) that the scipy ``operator``
    applies (such as ``hessian_operator(...).to_scipy()``), by Lanczos (ARPACK ``eigsh``,
    one eigenvalue of largest magnitude)."""
    n = operator.shape[0]
    start = np.random.default_rng(seed).standard_normal(n)
    values = eigsh(operator, k=1, which="LM", v0=start, tol=tol, ncv=min(n, 24),
                   maxiter=50 * n, return_eigenvectors=False)
    return float(np.abs(values).max())


def parameter_count(module: ModuleType, params: dict, wrt: list[str] | None = None) -> int:
    """``n``, the number of entries of the parameters ``wrt`` (default: all)."""
    names = wrt or [name for name, _ in module.PARAMS]
    return sum(params[name].numel() for name in names)


def hessian_norm(module: ModuleType, params: dict, X: torch.Tensor, target: torch.Tensor,
                 wrt: list[str] | None = None) -> float:
    """``‖∇²_w loss‖₂`` over ``wrt``: dense ``eigvalsh`` of the generated ``loss_hessian``
    up to :data:`DENSE_LIMIT` parameters, Lanczos on the generated ``hvp`` above."""
    n = parameter_count(module, params, wrt)
    if n <= DENSE_LIMIT:
        return symmetric_spectral_norm(module.loss_hessian(params, X, target, wrt))
    return lanczos_spectral_norm(hessian_operator(module, params, X, target, wrt).to_scipy())


def block_slices(module: ModuleType, params: dict) -> dict[str, slice]:
    """Where each parameter's ``vec_r`` sits in the loss Hessian, in ``PARAMS`` order."""
    slices, start = {}, 0
    for name, _ in module.PARAMS:
        size = params[name].numel()
        slices[name] = slice(start, start + size)
        start += size
    return slices


def block_norms(H: torch.Tensor, slices: dict[str, slice]) -> dict[tuple[str, str], dict]:
    """``{(a, b): {"spectral": ‖H_ab‖₂, "frobenius": ‖H_ab‖_F}}`` for every pair of
    blocks ``H_ab = H[slices[a], slices[b]]``."""
    norms = {}
    for a, rows in slices.items():
        for b, cols in slices.items():
            block = H[rows, cols]
            norms[a, b] = {"spectral": spectral_norm(block),
                           "frobenius": float(torch.linalg.matrix_norm(block))}
    return norms
