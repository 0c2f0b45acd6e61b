"""Row-wise normalisation (LayerNorm, RMSNorm): its nodes in index form, its line of
description, and its plain-PyTorch forward pass for verification. The options are ``norm``,
``eps``, ``affine`` and ``norm_bias`` (LayerNorm's ``beta``).

LayerNorm of row ``i`` of ``U``:
``mu_i = Σ_j U_ij / d``, ``C_ij = U_ij - mu_i``, ``var_i = Σ_j C_ij² / d``,
``r_i = (var_i + eps)^(-1/2)``, ``N_ij = C_ij r_i``, and with ``affine``
``out_ij = gamma_j N_ij + beta_j``. RMSNorm drops the centring and ``beta``:
``ms_i = Σ_j U_ij² / d``, ``r_i = (ms_i + eps)^(-1/2)``, ``N_ij = U_ij r_i``.
Every derivative of these nodes comes from the calculus in :mod:`.calculus`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp
import torch

from .functions import power
from .graph import Graph, Guard, Tensor

if TYPE_CHECKING:
    from .config import Config

TITLES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass
class Normalized:
    output: Tensor
    params: list[Tensor]
    guards: list[Guard]


def title(config: Config) -> str:
    """The sublayer's name: ``LayerNorm`` or ``RMSNorm``."""
    return TITLES[config.norm]


def normalize(g: Graph, U: Tensor, config: Config, out_name: str, prefix: str = "",
              suffix: str = "", argument: str = "X") -> Normalized:
    """Nodes normalising each row of ``U`` (shape ``L×d``), the last one named
    ``out_name``; parameters ``gamma<suffix>`` (and ``beta<suffix>``) when ``affine``."""
    kind, eps, affine = config.norm, config.eps, config.affine
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
    if config.norm_offset:  # scaled by (1 + gamma)
        expr = N[i, j] + expr
    if kind == "layernorm" and config.norm_bias:
        beta = g.input(f"beta{suffix}", (width,), role="param", batched=False)
        params.append(beta)
        expr = expr + beta[j]
    return Normalized(g.node(out_name, (i, j), expr), params, guards)


def describe(config: Config, argument: str = "U") -> str:
    """The sublayer as one line of text, a function of ``argument``."""
    if config.norm == "layernorm":
        formula = "(U - mean(U)) / sqrt(var(U) + eps)"
    else:
        formula = "U / sqrt(mean(U**2) + eps)"
    if config.affine:
        formula += (" * (1 + gamma)" if config.norm_offset else " * gamma") + (
            " + beta" if config.norm == "layernorm" and config.norm_bias else "")
    return (f"Norm({argument}) = {formula.replace('U', argument)} per row, "
            f"eps = {config.eps!r}")


def reference(config: Config, params: dict, U: torch.Tensor, suffix: str = "") -> torch.Tensor:
    """The sublayer on one sample ``U`` (``L×d``) in plain PyTorch, parameters
    ``gamma<suffix>``, ``beta<suffix>`` when present. Written out (mean, variance,
    ``rsqrt``): the double backward of ``torch.nn.functional.layer_norm`` through
    ``torch.func`` gave wrong mixed ``weight``–``input`` second derivatives in torch 2.13."""
    if config.norm == "layernorm":
        centred = U - U.mean(-1, keepdim=True)
        out = centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + config.eps)
    else:
        out = U * torch.rsqrt((U * U).mean(-1, keepdim=True) + config.eps)
    if f"gamma{suffix}" in params:
        out = out * (params[f"gamma{suffix}"] + (1.0 if config.norm_offset else 0.0))
    if f"beta{suffix}" in params:
        out = out + params[f"beta{suffix}"]
    return out
