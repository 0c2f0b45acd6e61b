"""The output head: its nodes in index form, its line of description, and its plain-PyTorch
forward pass for verification.

``Z = pool(X) W_H (+ b_H)``: the rows of ``X`` (``L×d``) pooled (``pooling = "mean"``: their
mean; ``"first"``: the first row, a ViT's class token; ``"none"``: every row kept), then
mapped to ``c`` outputs (the logits of ``c`` classes). A pooled output has one row, ``1×c``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import sizes
from .graph import Graph, Tensor

if TYPE_CHECKING:
    from .config import Config

TITLE = "Output head"


@dataclass
class Head:
    output: Tensor
    params: list[Tensor]


def head(g: Graph, X: Tensor, config: Config, out_name: str = "Z") -> Head:
    """Nodes of ``pool(X) W_H + b_H`` for ``X`` (``L×d``): ``Z`` is ``L×c`` without pooling,
    ``1×c`` with it."""
    L, d, c = sizes.L, sizes.d, sizes.c
    i, j, k = g.index(L, "i"), g.index(d, "j"), g.index(c, "k")
    W = g.input("W_H", (d, c), role="param", batched=False)
    params = [W]
    if config.pooling == "none":
        rows, value = i, X[i, j] * W[j, k]
    else:
        weights = g.row_weights(f"pool_{config.pooling}", L, config.pooling)
        rows = g.index(sizes.n_1, "o")
        pooled = g.node("U", (rows, j), weights[rows, i] * X[i, j])
        value = pooled[rows, j] * W[j, k]
    if config.head_bias:
        b = g.input("b_H", (c,), role="param", batched=False)
        params.append(b)
        value = value + b[k]
    return Head(g.node(out_name, (rows, k), value), params)


def describe(config: Config) -> str:
    """The sublayer as one line of text, a function of ``X``."""
    pooled = {"none": "X", "mean": "mean_rows(X)", "first": "X_0"}[config.pooling]
    return f"Z = {pooled} W_H{' + b_H' if config.head_bias else ''}"


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×d``) in plain PyTorch."""
    if config.pooling == "mean":
        X = X.mean(0, keepdim=True)
    elif config.pooling == "first":
        X = X[:1]
    return X @ params["W_H"] + params.get("b_H", 0.0)
