"""The position-wise feed-forward network as index-form nodes:

``H = Y W_1 (+ b_1)``, ``P = act(H)``, ``O = P W_2 (+ b_2)``, row by row, so every
derivative keeps the per-token independence: a tangent of ``H`` in ``W_1`` is
``Y[i, p] δ[f, q]``, never a dense ``(L·d_ff) × (d·d_ff)`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import sizes
from .functions import activation
from .graph import Graph, Tensor


@dataclass
class FeedForward:
    output: Tensor
    params: list[Tensor]


def feed_forward(g: Graph, Y: Tensor, act: str, bias: bool, out_name: str = "O") -> FeedForward:
    """Nodes of ``act(Y W_1 + b_1) W_2 + b_2`` for ``Y`` (``L×d``)."""
    L, d, d_ff = sizes.L, sizes.d, sizes.d_ff
    W_1 = g.input("W_1", (d, d_ff), role="param", batched=False)
    params = [W_1]
    i, c, f, e = g.index(L, "i"), g.index(d, "c"), g.index(d_ff, "f"), g.index(d, "e")
    pre = Y[i, c] * W_1[c, f]
    if bias:
        b_1 = g.input("b_1", (d_ff,), role="param", batched=False)
        params.append(b_1)
        pre = pre + b_1[f]
    H = g.node("H", (i, f), pre)
    P = g.node("P", (i, f), H.apply(activation(act), i, f))
    W_2 = g.input("W_2", (d_ff, d), role="param", batched=False)
    params.append(W_2)
    out = P[i, f] * W_2[f, e]
    if bias:
        b_2 = g.input("b_2", (d,), role="param", batched=False)
        params.append(b_2)
        out = out + b_2[e]
    return FeedForward(g.node(out_name, (i, e), out), params)
