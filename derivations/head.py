"""The output head: its nodes in index form, its line of description, and its plain-PyTorch
forward pass for verification.

``Z = pool(X) W_H (+ b_H)``: the rows of ``X`` (``L×d``) pooled (``pooling = "mean"``: their
mean; ``"first"``: the first row, a ViT's class token; ``"none"``: every row kept), then
mapped to ``c`` outputs (the logits of ``c`` classes). A pooled output has one row, ``1×c``.
With ``pooled_norm`` the pooled row is normalised first (timm's ``fc_norm``, the norm's
options as a layernorm's); with ``pooler`` it passes ``tanh(U W_P + b_P)`` (``d×d``, BERT's
pooler) before ``W_H``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sizes
from .functions import activation
from .graph import Graph, Guard, Tensor
from .normalization import describe as describe_norm
from .normalization import normalize
from .normalization import reference as reference_norm

if TYPE_CHECKING:
    from .config import Config

TITLE = "Output head"


@dataclass
class Head:
    output: Tensor
    params: list[Tensor]
    guards: list[Guard]


def head(g: Graph, X: Tensor, config: Config, out_name: str = "Z") -> Head:
    """Nodes of ``pool(X) W_H + b_H`` for ``X`` (``L×d``), the pooled rows normalised
    (``pooled_norm``) and passed through ``tanh(U W_P + b_P)`` (``pooler``) on the way: ``Z``
    is ``L×c`` without pooling, ``1×c`` with it."""
    L, d, c = sizes.L, sizes.d, sizes.c
    i, j, k = g.index(L, "i"), g.index(d, "j"), g.index(c, "k")
    params, guards = [], []
    if config.pooling == "none":
        pooled = X
    else:
        weights = g.row_weights(f"pool_{config.pooling}", L, config.pooling)
        rows = g.index(sizes.n_1, "o")
        pooled = g.node("U", (rows, j), weights[rows, i] * X[i, j])
    if config.pooled_norm:
        norm = normalize(g, pooled, config, "U_norm", prefix="pool_")
        pooled, params, guards = norm.output, norm.params, norm.guards
    rows = pooled.indices[0]
    if config.pooler:
        W_P = g.input("W_P", (d, d), role="param", batched=False)
        b_P = g.input("b_P", (d,), role="param", batched=False)
        params += [W_P, b_P]
        n = g.index(d, "n")
        dense = g.node("U_dense", (rows, n), pooled[rows, j] * W_P[j, n] + b_P[n])
        pooled = g.node("U_pooler", (rows, n), dense.apply(activation("tanh"), rows, n))
    W = g.input("W_H", (d, c), role="param", batched=False)
    params.insert(0, W)
    value = pooled[rows, j] * W[j, k]
    if config.head_bias:
        b = g.input("b_H", (c,), role="param", batched=False)
        params.insert(1, b)
        value = value + b[k]
    return Head(g.node(out_name, (rows, k), value), params, guards)


def describe(config: Config) -> str:
    """The sublayer as one line of text, a function of ``X``."""
    pooled = {"none": "X", "mean": "mean_rows(X)", "first": "X_0"}[config.pooling]
    if config.pooled_norm:
        pooled = f"Norm({pooled})"
    if config.pooler:
        pooled = f"tanh({pooled} W_P + b_P)"
    line = f"Z = {pooled} W_H{' + b_H' if config.head_bias else ''}"
    if config.pooled_norm:
        line += ", " + describe_norm(config)
    return line


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×d``) in plain PyTorch."""
    if config.pooling == "mean":
        X = X.mean(0, keepdim=True)
    elif config.pooling == "first":
        X = X[:1]
    if config.pooled_norm:
        X = reference_norm(config, params, X)
    if config.pooler:
        X = torch.tanh(X @ params["W_P"] + params["b_P"])
    return X @ params["W_H"] + params.get("b_H", 0.0)
