"""Single-head self-attention as index-form nodes (DESIGN.md §2, the paper's Sec. 1.3):

``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, ``T = Q K^T / sqrt(d_k)``,
``A = softmax_row(T)``, ``F = A V``.

The row softmax is written as ``E = exp(T - m)``, ``s_i = Σ_j E_ij``, ``A_ij = E_ij / s_i``
(nodes ``T_shift``, ``E``, ``E_sum``, ``A``) with ``m_i = max_j T_ij`` (``T_max``) a
constant shift: it leaves ``A`` unchanged for every value, so it carries no derivative and
only keeps ``exp`` from overflowing. Every derivative of the softmax then follows from
``exp`` and ``1/s`` by the calculus.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import sizes
from .functions import exp, power
from .graph import Graph, Tensor


@dataclass
class Attention:
    output: Tensor
    params: list[Tensor]
    softmax: Tensor


def softmax_rows(g: Graph, T: Tensor, name: str = "A", prefix: str = "") -> Tensor:
    """``name = softmax`` of each row of ``T`` (``L×L``)."""
    rows, cols = T.shape
    i, j = g.index(rows, "i"), g.index(cols, "j")
    m = g.row_max(f"{prefix}T_max", T)
    shifted = g.node(f"{prefix}T_shift", (i, j), T[i, j] - m[i])
    E = g.node(f"{prefix}E", (i, j), shifted.apply(exp(), i, j))
    s = g.node(f"{prefix}E_sum", (i,), E[i, j])
    return g.node(name, (i, j), E[i, j] * s.apply(power(-1, 0, "recip"), i))


def self_attention(g: Graph, X: Tensor, out_name: str = "F") -> Attention:
    """Nodes of ``F(X) = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V`` for ``X`` (``L×d``)."""
    L, d, d_k = sizes.L, sizes.d, sizes.d_k  # X: L×d
    W_Q = g.input("W_Q", (d, d_k), role="param", batched=False)
    W_K = g.input("W_K", (d, d_k), role="param", batched=False)
    W_V = g.input("W_V", (d, d), role="param", batched=False)
    i, j, c, a, e = (g.index(L, "i"), g.index(L, "j"), g.index(d, "c"), g.index(d_k, "a"),
                     g.index(d, "e"))
    Q = g.node("Q", (i, a), X[i, c] * W_Q[c, a])
    K = g.node("K", (j, a), X[j, c] * W_K[c, a])
    V = g.node("V", (j, e), X[j, c] * W_V[c, e])
    T = g.node("T_att", (i, j), (1 / sp.sqrt(d_k)) * Q[i, a] * K[j, a])
    A = softmax_rows(g, T)
    F = g.node(out_name, (i, e), A[i, j] * V[j, e])
    return Attention(F, [W_Q, W_K, W_V], A)
