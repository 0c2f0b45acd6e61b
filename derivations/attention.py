"""Self-attention (the paper's Sec. 1.3): its nodes in index form, its line of description,
and its plain-PyTorch forward pass for verification.

``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, ``T = Q K^T / sqrt(d_k)``,
``A = softmax_row(T)``, ``F = A V``; the options are ``heads``, ``causal`` and ``out_proj``.

The row softmax is the primitive of :mod:`.softmax`: its value is
``exp(T - max T) / Σ exp(T - max T)``, its derivatives are closed-form rules in centred
form (stable when attention saturates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp
import torch

from . import sizes
from .graph import Graph, Tensor
from .softmax import softmax_rows

if TYPE_CHECKING:
    from .config import Config

TITLE = "Self-attention"


@dataclass
class Attention:
    output: Tensor
    params: list[Tensor]
    softmax: Tensor
    #: shapes users pass when they differ from the engine's (heads split out of a width)
    external_shapes: dict[str, tuple[str, ...]]


def self_attention(g: Graph, X: Tensor, config: Config, out_name: str = "F") -> Attention:
    """Nodes of ``F(X) = softmax(X W_Q W_K^T X^T / sqrt(d_k)) X W_V`` for ``X`` (``L×d``);
    with ``heads > 1`` the columns of ``W_Q, W_K`` (``d × h·d_k``) and ``W_V`` (``d × d``)
    are split into heads (engine shapes ``d×h×d_k`` and ``d×h×d_v``, ``d_v = d/h``), and
    the concatenated heads are multiplied by ``W_O`` (``d × d``, engine shape
    ``h×d_v×d``)."""
    heads, causal, out_proj = config.heads, config.causal, config.out_proj
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


def describe(config: Config) -> str:
    """The sublayer as one line of text."""
    heads = (f"{config.heads} heads (W_Q, W_K, W_V split by columns, concatenated)"
             if config.heads > 1 else "one head")
    return ("F(X) = softmax(X W_Q W_K^T X^T / sqrt(d_k)"
            + (" + causal mask" if config.causal else "") + ") X W_V"
            + (" W_O" if config.out_proj else "") + f", {heads}")


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×d``) in plain PyTorch, parameters in the shapes
    users pass (``W_Q``, ``W_K``: ``d × h·d_k``)."""
    h, L, d = config.heads, X.shape[0], X.shape[1]
    d_k = params["W_Q"].shape[1] // h
    Q = (X @ params["W_Q"]).reshape(L, h, d_k).transpose(0, 1)
    K = (X @ params["W_K"]).reshape(L, h, d_k).transpose(0, 1)
    V = (X @ params["W_V"]).reshape(L, h, d // h).transpose(0, 1)
    scores = Q @ K.transpose(1, 2) / d_k ** 0.5
    if config.causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ V                   # h × L × d_v
    out = heads.transpose(0, 1).reshape(L, d)
    return out @ params["W_O"] if config.out_proj else out
