"""Row-wise normalisation (LayerNorm, RMSNorm) as index-form nodes.

LayerNorm of row ``i`` of ``U``:
``mu_i = Σ_j U_ij / d``, ``C_ij = U_ij - mu_i``, ``var_i = Σ_j C_ij² / d``,
``r_i = (var_i + eps)^(-1/2)``, ``N_ij = C_ij r_i``, and with ``affine``
``out_ij = gamma_j N_ij + beta_j``. RMSNorm drops the centring and ``beta``:
``ms_i = Σ_j U_ij² / d``, ``r_i = (ms_i + eps)^(-1/2)``, ``N_ij = U_ij r_i``.
Every derivative of these nodes comes from the calculus in :mod:`.calculus`.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .functions import power
from .graph import Graph, Guard, Tensor


@dataclass
class Normalized:
    output: Tensor
    params: list[Tensor]
    guards: list[Guard]


def normalize(g: Graph, U: Tensor, kind: str, eps: float, affine: bool,
              out_name: str, prefix: str = "", suffix: str = "",
              argument: str = "X") -> Normalized:
    """Nodes normalising each row of ``U`` (shape ``L×d``), the last one named
    ``out_name``; parameters ``gamma<suffix>`` (and ``beta<suffix>``) when ``affine``."""
    rows, width = U.shape
    i, j = g.index(rows, "i"), g.index(width, "j")
    inv_sqrt = power(sp.Rational(-1, 2), eps, "rsqrt")
    guards: list[Guard] = []
    if kind == "layernorm":
        mu = g.node(f"{prefix}mu", (i,), (1 / width) * U[i, j])
        C = g.node(f"{prefix}C", (i, j), U[i, j] - mu[i])
        spread = g.node(f"{prefix}var", (i,), (1 / width) * C[i, j] * C[i, j])
        centred = C
        if eps == 0:
            guards.append(Guard(
                spread.name, mu.name, argument,
                f"LayerNorm{suffix} needs every row variance > 0 (the paper's assumption "
                "min σ² > 0, here with eps = 0), but a row of its input has zero variance; "
                "set eps > 0 in the config or change the input"))
    else:
        spread = g.node(f"{prefix}ms", (i,), (1 / width) * U[i, j] * U[i, j])
        centred = U
        if eps == 0:
            guards.append(Guard(
                spread.name, spread.name, argument,
                f"RMSNorm{suffix} needs every row mean square > 0 (eps = 0), but a row "
                "of its input is zero; set eps > 0 in the config or change the input"))
    r = g.node(f"{prefix}r", (i,), spread.apply(inv_sqrt, i))
    params: list[Tensor] = []
    if not affine:
        out = g.node(out_name, (i, j), centred[i, j] * r[i])
        return Normalized(out, params, guards)
    N = g.node(f"{prefix}N", (i, j), centred[i, j] * r[i])
    gamma = g.input(f"gamma{suffix}", (width,), role="param", batched=False)
    params.append(gamma)
    expr = gamma[j] * N[i, j]
    if kind == "layernorm":
        beta = g.input(f"beta{suffix}", (width,), role="param", batched=False)
        params.append(beta)
        expr = expr + beta[j]
    return Normalized(g.node(out_name, (i, j), expr), params, guards)
