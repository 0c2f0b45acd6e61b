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
from .indexform import Expr, Index

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
    params: list[Tensor] = []

    def linear(k: str, source: Tensor, fan_in: Index, fan_out: Index) -> Expr:
        """``source W_k (+ b_k)`` row by row, declaring ``W_k`` (and ``b_k``)."""
        W = g.input(f"W_{k}", (fan_in.dim, fan_out.dim), role="param", batched=False)
        params.append(W)
        value = source[i, fan_in] * W[fan_in, fan_out]
        if bias:
            b = g.input(f"b_{k}", (fan_out.dim,), role="param", batched=False)
            params.append(b)
            value = value + b[fan_out]
        return value

    i, c, f, e = g.index(L, "i"), g.index(d, "c"), g.index(d_ff, "f"), g.index(d, "e")
    H = g.node("H", (i, f), linear("1", Y, c, f))
    P = g.node("P", (i, f), H.apply(activation(act), i, f))
    if config.ffn_gate:  # gated (SwiGLU, GeGLU): act(Y W_1) ∘ (Y W_3)
        H_up = g.node("H_up", (i, f), linear("3", Y, c, f))
        P = g.node("P_gated", (i, f), P[i, f] * H_up[i, f])
    out = linear("2", P, f, e)
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
    "gelu_fast": lambda u: 0.5 * u * (1.0 + torch.tanh(0.7978845608 * u
                                                       * (1.0 + 0.044715 * u * u))),
    "quick_gelu": lambda u: u * torch.sigmoid(1.702 * u),
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
