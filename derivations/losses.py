"""Per-sample losses of the output ``Z`` (``L×d``) as index-form nodes (DESIGN.md §2).

MSE: ``D_ij = Z_ij - T_ij``, ``ell = Σ_ij D_ij² / (L·d)``.
"""

from __future__ import annotations

from .graph import Graph, Tensor


def mse(g: Graph, Z: Tensor, target: Tensor) -> Tensor:
    """The per-sample mean squared error ``ell`` (a scalar per sample)."""
    rows, width = Z.shape
    i, j = g.index(rows, "i"), g.index(width, "j")
    D = g.node("D", (i, j), Z[i, j] - target[i, j])
    return g.node("ell", (), (1 / (rows * width)) * D[i, j] * D[i, j])
