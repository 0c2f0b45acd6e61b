"""Loss-Hessian blocks that are exactly sums of Kronecker products, kept as their factors.

A block over matrix parameters ``V`` (``p×q``) and ``W`` (``p'×q'``) in the ``vec_r`` layout
is ``Σ_k A_k ⊗ B_k`` with ``A_k`` of shape ``(p, p')`` and ``B_k`` of ``(q, q')``; on
``vec_r(U)`` of a ``p'×q'`` matrix ``U`` it acts as ``vec_r(Σ_k A_k U B_k^T)``, at
``O(p p' q' + p q q')`` per product instead of the ``p q p' q'`` of the dense block. One
product ``A ⊗ B`` of symmetric factors has the eigenvalues ``λ_i(A) μ_j(B)`` and the inverse
``A^{-1} ⊗ B^{-1}``: the spectrum of a block with ``(d²)²`` entries from two ``d × d``
eigendecompositions.
"""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any

import numpy as np
import torch

Factor = torch.Tensor | None  # None: an identity of the size the block gives it


class KroneckerSum:
    """``Σ_k A_k ⊗ B_k`` over ``(rows, columns)`` factor shapes ``(p, p')`` and ``(q, q')``:
    ``products`` is a list of pairs ``(A_k, B_k)``, ``None`` an identity."""

    def __init__(self, products: list[tuple[Factor, Factor]], left_shape: tuple[int, int],
                 right_shape: tuple[int, int]) -> None:
        if not products:
            raise ValueError("products: expected at least one (A, B) pair, got none")
        self.products = products
        self.left_shape, self.right_shape = tuple(left_shape), tuple(right_shape)
        (p, p2), (q, q2) = self.left_shape, self.right_shape
        self.shape = (p * q, p2 * q2)
        like = next((f for pair in products for f in pair if f is not None), None)
        if like is None:
            raise ValueError("products: expected a factor that is not an identity, got only "
                             "identities")
        self.dtype, self.device = like.dtype, like.device

    def _factor(self, factor: Factor, shape: tuple[int, int]) -> torch.Tensor:
        return torch.eye(*shape, dtype=self.dtype, device=self.device) if factor is None \
            else factor

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        """The block times ``v`` of shape ``(p' q',)`` or ``(p' q', k)``."""
        if v.ndim not in (1, 2) or v.shape[0] != self.shape[1]:
            raise ValueError(f"v: expected shape ({self.shape[1]},) or ({self.shape[1]}, k), "
                             f"got shape {tuple(v.shape)}")
        (_, p2), (_, q2) = self.left_shape, self.right_shape
        U = v.reshape(p2, q2, -1)
        out = 0
        for A, B in self.products:
            AU = U if A is None else torch.einsum("ab,bck->ack", A, U)
            out = out + (AU if B is None else torch.einsum("ack,dc->adk", AU, B))
        return out.reshape(self.shape[0], *v.shape[1:])

    def to_dense(self) -> torch.Tensor:
        """The block itself, ``(p q, p' q')``."""
        return sum(torch.kron(self._factor(A, self.left_shape),
                              self._factor(B, self.right_shape)) for A, B in self.products)

    def _single(self, what: str) -> tuple[Factor, Factor]:
        (p, p2), (q, q2) = self.left_shape, self.right_shape
        if len(self.products) != 1 or p != p2 or q != q2:
            raise ValueError(f"{what}: expected one Kronecker product of square factors, got "
                             f"{len(self.products)} products of {self.left_shape} and "
                             f"{self.right_shape} (use to_dense() or an operator)")
        return self.products[0]

    def eigvalsh(self) -> torch.Tensor:
        """The eigenvalues of a symmetric block ``A ⊗ B``, ascending, ``(p q,)``: every
        ``λ_i(A) μ_j(B)``."""
        A, B = self._single("eigvalsh")
        (p, _), (q, _) = self.left_shape, self.right_shape
        ones = torch.ones
        left = ones(p, dtype=self.dtype, device=self.device) if A is None \
            else torch.linalg.eigvalsh(A)
        right = ones(q, dtype=self.dtype, device=self.device) if B is None \
            else torch.linalg.eigvalsh(B)
        return torch.sort(torch.outer(left, right).reshape(-1)).values

    def condition(self) -> float:
        """The 2-norm condition number of a block ``A ⊗ B``: ``cond(A) · cond(B)`` (inf
        when a factor is singular)."""
        return math.prod(self._conditions())

    def _conditions(self) -> tuple[float, float]:
        A, B = self._single("condition")
        return tuple(1.0 if F is None else _condition(torch.linalg.svdvals(F))
                     for F in (A, B))

    def solve(self, v: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
        """``x`` with ``(A ⊗ B + damping · I) x = v``, ``v`` of shape ``(p q,)`` or
        ``(p q, k)``: ``vec_r(A^{-1} V B^{-T})`` without damping; with it (symmetric factors
        ``A = Q Λ Q^T``, ``B = R M R^T``) ``vec_r(Q ((Q^T V R) / (λ_i μ_j + damping)) R^T)``.

        A block that is numerically singular in its dtype, its condition number at least
        ``1 / (p q · eps)`` (the rank tolerance of ``torch.linalg.matrix_rank``), is refused
        with a ``ValueError`` giving the condition number, never solved into a meaningless
        answer; ``damping`` (> 0, named by the caller: a Levenberg–Marquardt or Tikhonov
        term) solves the damped block instead. Below the limit the answer is as accurate as
        the condition number allows (a relative error of about ``cond · eps``)."""
        A, B = self._single("solve")
        if v.ndim not in (1, 2) or v.shape[0] != self.shape[0]:
            raise ValueError(f"v: expected shape ({self.shape[0]},) or ({self.shape[0]}, k), "
                             f"got shape {tuple(v.shape)}")
        if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or \
                not math.isfinite(damping) or damping < 0:
            raise ValueError(f"damping: expected a finite number >= 0, got {damping!r}")
        (p, _), (q, _) = self.left_shape, self.right_shape
        eps = torch.finfo(self.dtype).eps
        limit = 1 / (p * q * eps)
        if damping:
            return self._damped_solve(v, float(damping), limit)
        cond_A, cond_B = self._conditions()
        if not cond_A * cond_B < limit:
            raise ValueError(
                f"solve: expected a block that is invertible in {self.dtype}, got A ⊗ B with "
                f"condition number {cond_A * cond_B:.3g} (A: {cond_A:.3g}, B: {cond_B:.3g}), "
                f"at or above {limit:.3g} = 1/(p·q·eps) where it is numerically singular: "
                "pass damping > 0 to solve (A ⊗ B + damping·I) x = v")
        U = v.reshape(p, q, -1)
        if A is not None:
            U = torch.linalg.solve(A, U.reshape(p, -1)).reshape(p, q, -1)
        if B is not None:
            U = torch.linalg.solve(B, U.transpose(0, 1).reshape(q, -1)).reshape(
                q, p, -1).transpose(0, 1)
        return U.reshape(*v.shape)

    def _damped_solve(self, v: torch.Tensor, damping: float, limit: float) -> torch.Tensor:
        """``(A ⊗ B + damping · I)^{-1} v`` through the eigendecompositions of the factors."""
        (p, _), (q, _) = self.left_shape, self.right_shape
        pairs = []
        for name, F, size in (("A", self.products[0][0], p), ("B", self.products[0][1], q)):
            if F is None:
                pairs.append((torch.ones(size, dtype=self.dtype, device=self.device), None))
                continue
            asymmetry = float((F - F.T).abs().max())
            if asymmetry > torch.finfo(self.dtype).eps ** 0.5 * float(F.abs().max()):
                raise ValueError(f"damping: expected symmetric factors (a Hessian block on "
                                 f"its diagonal), got factor {name} with |{name} - {name}^T| "
                                 f"up to {asymmetry:.3g}")
            pairs.append(torch.linalg.eigh((F + F.T) / 2))
        (left, Q), (right, R) = pairs
        W = torch.outer(left, right) + damping
        cond = _condition(W.abs().reshape(-1))
        if not cond < limit:
            raise ValueError(
                f"solve: expected a damped block that is invertible in {self.dtype}, got "
                f"A ⊗ B + {damping:.3g}·I with condition number {cond:.3g}, at or above "
                f"{limit:.3g} = 1/(p·q·eps) where it is numerically singular: pass a larger "
                "damping")
        U = v.reshape(p, q, -1)
        if Q is not None:
            U = torch.einsum("ab,bck->ack", Q.T, U)
        if R is not None:
            U = torch.einsum("ack,cd->adk", U, R)
        U = U / W[:, :, None]
        if Q is not None:
            U = torch.einsum("ab,bck->ack", Q, U)
        if R is not None:
            U = torch.einsum("ack,dc->adk", U, R)
        return U.reshape(*v.shape)


def _condition(values: torch.Tensor) -> float:
    """``max / min`` of nonnegative ``values`` (singular values), inf when the least is 0."""
    largest, least = float(values.max()), float(values.min())
    return math.inf if least == 0 or not math.isfinite(largest / least) else largest / least


def kronecker_block(module: ModuleType, params: dict, X: Any, target: Any, wrt_i: str,
                    wrt_j: str | None = None, part: str = "full") -> KroneckerSum:
    """The block ``(wrt_i, wrt_j)`` of ``part`` of a generated ``module``'s loss Hessian as a
    :class:`KroneckerSum` (torch tensors; a numpy module's factors converted), for the blocks
    the module lists in ``STRUCTURED``."""
    products = module.kronecker_factors(params, X, target, wrt_i, wrt_j, part)
    (p, q), (p2, q2) = np.shape(params[wrt_i]), np.shape(params[wrt_j or wrt_i])

    def tensor(factor: Any) -> Factor:
        return None if factor is None else torch.as_tensor(factor)

    return KroneckerSum([(tensor(A), tensor(B)) for A, B in products], (p, p2), (q, q2))
