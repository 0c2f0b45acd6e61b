"""Single-head self-attention as index-form nodes (the paper's Sec. 1.3):

``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, ``T = Q K^T / sqrt(d_k)``,
``A = softmax_row(T)``, ``F = A V``.

The row softmax is the primitive of :mod:`.softmax`: its value is
``exp(T - max T) / Σ exp(T - max T)``, its derivatives are closed-form rules in centred
form (stable when attention saturates).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import sizes
from .graph import Graph, Tensor
from .softmax import softmax_rows


@dataclass
class Attention:
    output: Tensor
    params: list[Tensor]
    softmax: Tensor
    #: shapes users pass when they differ from the engine's (heads split out of a width)
    external_shapes: dict[str, tuple[str, ...]]


def self_attention(g: Graph, X: Tensor, heads: int = 1, causal: bool = False,
                   out_proj: bool = False, out_name: str = "F") -> Attention:
    """Nodes of ``F(X) = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V`` for ``X`` (``L×d``);
    with ``heads > 1`` the columns of ``W_Q, W_K`` (``d × h·d_k``) and ``W_V`` (``d × d``)
    are split into heads (engine shapes ``d×h×d_k`` and ``d×h×d_v``, ``d_v = d/h``), and
    the concatenated heads are multiplied by ``W_O`` (``d × d``, engine shape
    ``h×d_v×d``)."""
    L, d, d_k, d_v, h = sizes.L, sizes.d, sizes.d_k, sizes.d_v, sizes.h
    if heads > 1 and not out_proj:
        raise NotImplementedError("heads > 1 without out_proj")
    split = heads > 1
    H = (g.index(h, "h"),) if split else ()
    i, j, c, a = g.index(L, "i"), g.index(L, "j"), g.index(d, "c"), g.index(d_k, "a")
    e = g.index(d_v if split else d, "e")
    W_Q = g.input("W_Q", (d, *(h,) * split, d_k), role="param", batched=False)
    W_K = g.input("W_K", (d, *(h,) * split, d_k), role="param", batched=False)
    W_V = g.input("W_V", (d, *(h,) * split, d_v if split else d), role="param", batched=False)
    Q = g.node("Q", (i, *H, a), X[i, c] * W_Q[(c, *H, a)])
    K = g.node("K", (j, *H, a), X[j, c] * W_K[(c, *H, a)])
    V = g.node("V", (j, *H, e), X[j, c] * W_V[(c, *H, e)])
    T = g.node("T_att", (*H, i, j), (1 / sp.sqrt(d_k)) * Q[(i, *H, a)] * K[(j, *H, a)])
    A = softmax_rows(g, T, causal=causal)
    params = [W_Q, W_K, W_V]
    external = {}
    if not out_proj:
        F = g.node(out_name, (i, e), A[(*H, i, j)] * V[(j, *H, e)])
        return Attention(F, params, A, external)
    heads_out = g.node("F_heads", (i, *H, e), A[(*H, i, j)] * V[(j, *H, e)])
    W_O = g.input("W_O", (*(h,) * split, d_v if split else d, d), role="param", batched=False)
    params.append(W_O)
    out = g.index(d, "o")
    F = g.node(out_name, (i, out), heads_out[(i, *H, e)] * W_O[(*H, e, out)])
    if split:
        external = {"W_Q": ("d", "h*d_k"), "W_K": ("d", "h*d_k"), "W_V": ("d", "d"),
                    "W_O": ("d", "d")}
    return Attention(F, params, A, external)
