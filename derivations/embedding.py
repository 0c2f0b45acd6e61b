"""The input embedding: its nodes in index form, its line of description, and its
plain-PyTorch forward pass for verification.

``Z = X W_E (+ b_E) (+ P_E)`` row by row: a linear embedding of ``p`` input features per
position (the patches of a ViT, flattened), an optional bias and an optional learned
positional embedding ``P_E`` (``L×d``). Without ``projection`` the input is already
embedded (``L×d``, as GPT-2's ``inputs_embeds``): ``Z = X (+ b_E) (+ P_E)``. With
``class_token`` the first row is the learned token ``c_E`` instead (``Z_0 = c_E (+ P_E,0)``;
the first row of ``X`` is a placeholder whose values are not read), as a ViT prepends its
class token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sizes
from .graph import Graph, Tensor

if TYPE_CHECKING:
    from .config import Config

TITLE = "Input embedding"


@dataclass
class Embedding:
    output: Tensor
    params: list[Tensor]


def embed(g: Graph, X: Tensor, config: Config, out_name: str = "Z") -> Embedding:
    """Nodes of ``X W_E + b_E + P_E`` for ``X`` (``L×p``; ``L×d`` without ``projection``),
    the options deciding which terms there are; with ``class_token`` the first row replaced
    by ``c_E + P_E,0``."""
    L, d, p = sizes.L, sizes.d, sizes.p
    i, f, j, o = g.index(L, "i"), g.index(p, "f"), g.index(d, "j"), g.index(sizes.n_1, "o")
    params = []
    if config.projection:
        W = g.input("W_E", (p, d), role="param", batched=False)
        params.append(W)
        linear = X[i, f] * W[f, j]
    else:
        linear = X[i, j]
    if config.embedding_bias:
        b = g.input("b_E", (d,), role="param", batched=False)
        params.append(b)
        linear = linear + b[j]
    value = linear
    if config.class_token:  # the first row is the token, the others their embedding
        first = g.row_weights("first_row", L, "first")
        rest = g.row_weights("other_rows", L, "rest")
        token = g.input("c_E", (d,), role="param", batched=False)
        params.append(token)
        value = rest[o, i] * linear + first[o, i] * token[j]
    if config.positional:
        P = g.input("P_E", (L, d), role="param", batched=False)
        params.append(P)
        value = value + P[i, j]
    return Embedding(g.node(out_name, (i, j), value), params)


def describe(config: Config) -> str:
    """The sublayer as one line of text, a function of ``X``."""
    bias = " + b_E" if config.embedding_bias else ""
    position = " + P_E" if config.positional else ""
    line = f"Z = X{' W_E' if config.projection else ''}{bias}{position}, row by row"
    if config.class_token:
        line += f"; the first row is the class token, Z_0 = c_E{' + P_E,0' if position else ''}"
    return line


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×p``, or ``L×d``) in plain PyTorch."""
    Z = (X @ params["W_E"] if config.projection else X) + params.get("b_E", 0.0)
    if config.class_token:
        Z = torch.cat([params["c_E"][None], Z[1:]])
    return Z + params.get("P_E", 0.0)
