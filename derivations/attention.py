"""Self-attention (the paper's Sec. 1.3): its nodes in index form, its line of description,
and its plain-PyTorch forward pass for verification.

``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, ``T = Q K^T / sqrt(d_k)``,
``A = softmax_row(T)``, ``F = A V``; the options are ``heads``, ``causal``, ``out_proj``,
``attention_bias`` (``b_Q, b_K, b_V`` and ``b_O``) and ``attention_scale``.

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
    """Nodes of ``F(X) = softmax(s (X W_Q + b_Q)(X W_K + b_K)^T) (X W_V + b_V)`` for ``X``
    (``L×d``), ``s = 1/sqrt(d_k)`` unless ``attention_scale`` says otherwise, the biases
    when ``attention_bias``; with ``heads > 1`` the columns of ``W_Q, W_K`` (``d × h·d_k``)
    and ``W_V`` (``d × d``), and the entries of their biases, are split into heads (engine
    shapes ``d×h×d_k`` and ``d×h×d_v``, ``d_v = d/h``), and the concatenated heads are
    multiplied by ``W_O`` (``d × d``, engine shape ``h×d_v×d``) and shifted by ``b_O``."""
    heads, causal, out_proj = config.heads, config.causal, config.out_proj
    bias = config.attention_bias
    L, d, d_k, d_v, h = sizes.L, sizes.d, sizes.d_k, sizes.d_v, sizes.h
    if heads > 1 and not out_proj:
        raise NotImplementedError("heads > 1 without out_proj")
    split = heads > 1
    H = (g.index(h, "h"),) if split else ()
    i, j, c, a = g.index(L, "i"), g.index(L, "j"), g.index(d, "c"), g.index(d_k, "a")
    e = g.index(d_v if split else d, "e")
    widths = {"Q": (d_k, a), "K": (d_k, a), "V": (d_v if split else d, e)}
    weights, biases, params = {}, {}, []
    for name, (width, _) in widths.items():  # declared first: parameter order W_Q, b_Q, ...
        weights[name] = g.input(f"W_{name}", (d, *(h,) * split, width), role="param",
                                batched=False)
        params.append(weights[name])
        if bias:
            biases[name] = g.input(f"b_{name}", (*(h,) * split, width), role="param",
                                   batched=False)
            params.append(biases[name])
    projected = {}
    for name, rows in (("Q", i), ("K", j), ("V", j)):
        column = widths[name][1]
        value = X[rows, c] * weights[name][(c, *H, column)]
        if bias:
            value = value + biases[name][(*H, column)]
        projected[name] = g.node(name, (rows, *H, column), value)
    Q, K, V = projected["Q"], projected["K"], projected["V"]
    scale = _exactly(config.attention_scale) if config.attention_scale else 1 / sp.sqrt(d_k)
    T = g.node("T_att", (*H, i, j), scale * Q[(i, *H, a)] * K[(j, *H, a)])
    A = softmax_rows(g, T, causal=causal)
    external = {}
    if split:
        external = {"W_Q": ("d", "h*d_k"), "W_K": ("d", "h*d_k"), "W_V": ("d", "d"),
                    "W_O": ("d", "d"), "b_Q": ("h*d_k",), "b_K": ("h*d_k",), "b_V": ("d",)}
    if not out_proj:
        F = g.node(out_name, (i, e), A[(*H, i, j)] * V[(j, *H, e)])
        return Attention(F, params, A, external)
    heads_out = g.node("F_heads", (i, *H, e), A[(*H, i, j)] * V[(j, *H, e)])
    W_O = g.input("W_O", (*(h,) * split, d_v if split else d, d), role="param", batched=False)
    params.append(W_O)
    out = g.index(d, "o")
    value = heads_out[(i, *H, e)] * W_O[(*H, e, out)]
    if bias:
        b_O = g.input("b_O", (d,), role="param", batched=False)
        params.append(b_O)
        value = value + b_O[out]
    F = g.node(out_name, (i, out), value)
    return Attention(F, params, A, {k: v for k, v in external.items()
                                    if k in {p.name for p in params}})


def _exactly(value: float) -> sp.Rational:
    """``value`` as a short fraction when one rounds to it (``0.3`` → ``3/10``), else as the
    exact binary fraction it is."""
    short = sp.nsimplify(value, rational=True)
    return short if float(short) == value else sp.Rational(value)


def describe(config: Config) -> str:
    """The sublayer as one line of text."""
    heads = (f"{config.heads} heads (W_Q, W_K, W_V split by columns, concatenated)"
             if config.heads > 1 else "one head")
    if config.attention_bias:
        scores, values, out = "(X W_Q + b_Q) (X W_K + b_K)^T", "(X W_V + b_V)", " W_O + b_O"
    else:
        scores, values, out = "X W_Q W_K^T X^T", "X W_V", " W_O"
    scale = (f"{config.attention_scale!r} {scores}" if config.attention_scale
             else f"{scores} / sqrt(d_k)")
    return (f"F(X) = softmax({scale}" + (" + causal mask" if config.causal else "")
            + f") {values}"
            + (out if config.out_proj else "") + f", {heads}")


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×d``) in plain PyTorch, parameters in the shapes
    users pass (``W_Q``, ``W_K``: ``d × h·d_k``)."""
    h, L, d = config.heads, X.shape[0], X.shape[1]
    d_k = params["W_Q"].shape[1] // h
    Q = (X @ params["W_Q"] + params.get("b_Q", 0.0)).reshape(L, h, d_k).transpose(0, 1)
    K = (X @ params["W_K"] + params.get("b_K", 0.0)).reshape(L, h, d_k).transpose(0, 1)
    V = (X @ params["W_V"] + params.get("b_V", 0.0)).reshape(L, h, d // h).transpose(0, 1)
    scores = Q @ K.transpose(1, 2)
    scores = scores * config.attention_scale if config.attention_scale else scores / d_k ** 0.5
    if config.causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ V                   # h × L × d_v
    out = heads.transpose(0, 1).reshape(L, d)
    return out @ params["W_O"] + params.get("b_O", 0.0) if config.out_proj else out
