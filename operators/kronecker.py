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

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        """``x`` with ``(A ⊗ B) x = v``, ``v`` of shape ``(p q,)`` or ``(p q, k)``:
        ``vec_r(A^{-1} V B^{-T})``."""
        A, B = self._single("solve")
        if v.ndim not in (1, 2) or v.shape[0] != self.shape[0]:
            raise ValueError(f"v: expected shape ({self.shape[0]},) or ({self.shape[0]}, k), "
                             f"got shape {tuple(v.shape)}")
        (p, _), (q, _) = self.left_shape, self.right_shape
        U = v.reshape(p, q, -1)
        if A is not None:
            U = torch.linalg.solve(A, U.reshape(p, -1)).reshape(p, q, -1)
        if B is not None:
            U = torch.linalg.solve(B, U.transpose(0, 1).reshape(q, -1)).reshape(
                q, p, -1).transpose(0, 1)
        return U.reshape(*v.shape)


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
