"""The position-wise feed-forward network: its nodes in index form, its line of description,
and its plain-PyTorch forward pass for verification.

``H = Y W_1 (+ b_1)``, ``P = act(H)``, ``O = P W_2 (+ b_2)``, row by row (the options are
``activation``, ``ffn_bias`` and ``ffn_gate``: ``P ∘ (Y W_3 + b_3)`` in place of ``P``, as
SwiGLU and GeGLU), so every
derivative keeps the per-token independence: a tangent of ``H`` in ``W_1`` is
``Y[i, p] δ[f, q]``, never a dense ``(L·d_ff) × (d·d_ff)`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sizes
from .functions import activation
from .graph import Graph, Tensor

if TYPE_CHECKING:
    from .config import Config

TITLE = "Feed-forward network"


@dataclass
class FeedForward:
    output: Tensor
    params: list[Tensor]


def feed_forward(g: Graph, Y: Tensor, config: Config, out_name: str = "O") -> FeedForward:
    """Nodes of ``act(Y W_1 + b_1) W_2 + b_2`` for ``Y`` (``L×d``), or with ``ffn_gate``
    ``(act(Y W_1 + b_1) ∘ (Y W_3 + b_3)) W_2 + b_2`` (``W_3``: ``d × d_ff``)."""
    act, bias = config.activation, config.ffn_bias
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
    if config.ffn_gate:  # gated (SwiGLU, GeGLU): act(Y W_1) ∘ (Y W_3)
        W_3 = g.input("W_3", (d, d_ff), role="param", batched=False)
        params.append(W_3)
        up = Y[i, c] * W_3[c, f]
        if bias:
            b_3 = g.input("b_3", (d_ff,), role="param", batched=False)
            params.append(b_3)
            up = up + b_3[f]
        H_up = g.node("H_up", (i, f), up)
        P = g.node("P_gated", (i, f), P[i, f] * H_up[i, f])
    W_2 = g.input("W_2", (d_ff, d), role="param", batched=False)
    params.append(W_2)
    out = P[i, f] * W_2[f, e]
    if bias:
        b_2 = g.input("b_2", (d,), role="param", batched=False)
        params.append(b_2)
        out = out + b_2[e]
    return FeedForward(g.node(out_name, (i, e), out), params)


def describe(config: Config, argument: str = "Y") -> str:
    """The sublayer as one line of text, a function of ``argument``."""
    b_1, b_2, b_3 = (" + b_1", " + b_2", " + b_3") if config.ffn_bias else ("", "", "")
    hidden = f"{config.activation}({argument} W_1{b_1})"
    if config.ffn_gate:
        hidden = f"({hidden} * ({argument} W_3{b_3}))"
    return f"FFN({argument}) = {hidden} W_2{b_2}"


#: The activations in plain PyTorch (the reference the generated code is checked against).
ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda u: torch.nn.functional.gelu(u, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    # log(1 + e^u) exactly (F.softplus returns u itself above u = 20, off by e^-20)
    "softplus": lambda u: torch.logaddexp(u, torch.zeros_like(u)),
    "identity": lambda u: u,
}


def reference(config: Config, params: dict, Y: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``Y`` (``L×d``) in plain PyTorch."""
    hidden = ACTIVATIONS[config.activation](Y @ params["W_1"] + params.get("b_1", 0.0))
    if config.ffn_gate:
        hidden = hidden * (Y @ params["W_3"] + params.get("b_3", 0.0))
    return hidden @ params["W_2"] + params.get("b_2", 0.0)
