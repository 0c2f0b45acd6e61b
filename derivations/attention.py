"""Self-attention (the paper's Sec. 1.3): its nodes in index form, its line of description,
and its plain-PyTorch forward pass for verification.

``Q = X W_Q``, ``K = X W_K``, ``V = X W_V``, ``T = Q K^T / sqrt(d_k)``,
``A = softmax_row(T)``, ``F = A V``; the options are ``heads``, ``kv_heads`` (grouped-query
attention), ``causal``, ``out_proj``, ``attention_bias`` (``b_Q, b_K, b_V`` and ``b_O``),
``attention_scale``, ``rotary`` (with ``rotary_base``) and ``logit_softcap`` (scores
``cap · tanh(T / cap)`` before the softmax, as Gemma 2's).

The row softmax is the primitive of :mod:`.softmax`: its value is
``exp(T - max T) / Σ exp(T - max T)``, its derivatives are closed-form rules in centred
form (stable when attention saturates).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import sympy as sp
import torch

from . import sizes
from .functions import ScalarFn, x
from .graph import Graph, Tensor
from .softmax import softmax_rows

if TYPE_CHECKING:
    from .config import Config

TITLE = "Self-attention"
CROSS_TITLE = "Cross-attention"


def own(config: Config) -> Config:
    """The self-attention of ``config`` (a block's, whose ``cross_attention`` is a sublayer
    of its own)."""
    return replace(config, cross_attention=False) if config.kind == "block" else config


def crossed(config: Config) -> Config:
    """A block's cross-attention: its heads, widths and biases, no position terms (causal
    mask, rotary, relative bias: the self-attention's), keys and values from ``M``."""
    return replace(config, cross_attention=True, causal=False, rotary=False,
                   relative_bias=False)


@dataclass
class Attention:
    output: Tensor
    params: list[Tensor]
    softmax: Tensor
    #: shapes users pass when they differ from the engine's (heads split out of a width)
    external_shapes: dict[str, tuple[str, ...]]


def _rotated(g: Graph, config: Config, Q: Tensor, K: Tensor, rows: tuple, heads: tuple,
             columns: tuple, chunks: object) -> tuple[Tensor, Tensor]:
    """``Q`` and ``K`` with each head's pairs of entries turned by their rows' angles: entry
    ``(s, m)`` of row ``i`` is ``Σ_t R[i, s, t, m] · (entry (t, m))`` (:meth:`Graph.rotary`)."""
    (i, j), (query_heads, kv_heads), (s_, m) = rows, heads, columns
    R = g.rotary("R_rot", sizes.L, chunks, sizes.d_r, config.rotary_base,
                 rotary_scaling(config))
    t = g.index(chunks, "t")
    Q = g.node("Q_rot", (i, *query_heads, s_, m), R[i, s_, t, m] * Q[(i, *query_heads, t, m)])
    K = g.node("K_rot", (j, *kv_heads, s_, m), R[j, s_, t, m] * K[(j, *kv_heads, t, m)])
    return Q, K


def self_attention(g: Graph, X: Tensor, config: Config, out_name: str = "F",
                   suffix: str = "") -> Attention:
    """Nodes of ``F(X) = softmax(s (X W_Q + b_Q)(X W_K + b_K)^T) (X W_V + b_V)`` for ``X``
    (``L×d``), ``s = 1/sqrt(d_k)`` unless ``attention_scale`` says otherwise, the biases
    when ``attention_bias``.

    With ``heads > 1`` the columns of ``W_Q, W_K`` (``d × h·d_k``) and ``W_V`` (``d × d``),
    and the entries of their biases, are split into heads (engine shapes ``d×h×d_k`` and
    ``d×h×d_v``, ``d_v = d/h``), and the concatenated heads are multiplied by ``W_O``
    (``d × d``, engine shape ``h×d_v×d``) and shifted by ``b_O``. With ``kv_heads = g < h``
    (grouped-query attention) ``W_K, W_V`` have ``g`` heads (``d × g·d_k``, ``d × g·d_v``)
    and query head ``q`` uses key/value head ``q // r``, ``r = h/g``: the query heads are
    indexed ``(g, r)``. With ``rotary`` each head's ``d_k`` entries of ``Q`` and ``K`` are
    split into halves ``(n_2, d_r)``, ``d_r = d_k/2``, and the pair of entries ``m`` and
    ``d_r + m`` of row ``i`` is turned by the angle ``i · base^(-m/d_r)``
    (:meth:`Graph.rotary`). With ``cross_attention`` the keys and values are those of a
    second input ``M`` (``L_m×d``, an encoder's states), a per-sample constant of the call:
    ``softmax(s (X W_Q)(M W_K)^T) (M W_V)``. ``suffix`` ends the names of its parameters and
    nodes (``"_c"``: a block's cross-attention, ``W_Q_c``, …)."""
    heads, out_proj, biased = config.heads, config.out_proj, config.attention_bias
    L, d, d_k = sizes.L, sizes.d, sizes.d_k
    d_v = d_k if config.value_width == "d_k" else sizes.d_v
    if heads > 1 and not out_proj:
        raise NotImplementedError("heads > 1 without out_proj")
    split = heads > 1
    keyed = sizes.L_m if config.cross_attention else L  # the rows keys and values come from
    i, j, c = g.index(L, "i"), g.index(keyed, "j"), g.index(d, "c")
    if config.kv_heads:  # query head (kv head, member of its group)
        kv_heads = (g.index(sizes.g, "g"),)
        query_heads = (*kv_heads, g.index(sizes.r, "r"))
    else:
        kv_heads = query_heads = (g.index(sizes.h, "h"),) if split else ()
    chunks = sizes.n_2 if config.rotary_fraction == 1 else sizes.n_r
    if config.rotary:  # a head's entries as (chunk, frequency); the first two chunks turn
        columns = (g.index(chunks, "s"), g.index(sizes.d_r, "m"))
    else:
        columns = (g.index(d_k, "a"),)
    value_columns = (g.index(d_v if split or config.value_width == "d_k" else d, "e"),)
    heads_of = {"Q": query_heads, "K": kv_heads, "V": kv_heads}
    columns_of = {"Q": columns, "K": columns, "V": value_columns}
    weights, biases, params = {}, {}, []
    for name in "QKV":  # declared first: parameter order W_Q, b_Q, ...
        shape = tuple(k.dim for k in (*heads_of[name], *columns_of[name]))
        weights[name] = g.input(f"W_{name}{suffix}", (d, *shape), role="param",
                                batched=False)
        params.append(weights[name])
        if name.lower() in biased:
            biases[name] = g.input(f"b_{name}{suffix}", shape, role="param", batched=False)
            params.append(biases[name])
    # cross-attention: keys and values from M (L_m×d, the encoder's states), given per sample
    # with the call and held constant (no derivative is taken in it)
    M = g.input("M", (keyed, d), role="constant") if config.cross_attention else X
    projected = {}
    for name, rows, source in (("Q", i, X), ("K", j, M), ("V", j, M)):
        entry = (*heads_of[name], *columns_of[name])
        value = source[rows, c] * weights[name][(c, *entry)]
        if name in biases:
            value = value + biases[name][entry]
        projected[name] = g.node(f"{name}{suffix}", (rows, *entry), value)
    Q, K, V = projected["Q"], projected["K"], projected["V"]
    if config.rotary:
        Q, K = _rotated(g, config, Q, K, (i, j), (query_heads, kv_heads), columns, chunks)
    scale = _exactly(config.attention_scale) if config.attention_scale else 1 / sp.sqrt(d_k)
    scores = scale * Q[(i, *query_heads, *columns)] * K[(j, *kv_heads, *columns)]
    if config.relative_bias:  # T5's learned bias of each head and offset bucket
        buckets = g.relative_buckets("P_rel", L, config.relative_max_distance,
                                     not config.causal)
        u = g.index(sizes.n_u, "u")
        E = g.input("E_rel", (sizes.n_u, *(k.dim for k in query_heads)), role="param",
                    batched=False)
        params.append(E)
        scores = scores + buckets[i, j, u] * E[(u, *query_heads)]
    T = g.node(f"T_att{suffix}", (*query_heads, i, j), scores)
    if config.logit_softcap:  # the scores capped smoothly at ± cap before the softmax
        cap = _exactly(config.logit_softcap)
        capped = ScalarFn("softcap", cap * sp.tanh(x / cap))
        T = g.node(f"T_cap{suffix}", T.indices, T.apply(capped, *T.indices))
    A = softmax_rows(g, T, f"A{suffix}", f"{suffix[1:]}_" if suffix else "",
                     causal=config.causal)
    e = value_columns[0]
    if not out_proj:
        F = g.node(out_name, (i, e), A[(*query_heads, i, j)] * V[(j, *kv_heads, e)])
        return Attention(F, params, A, _external_shapes(config, params, suffix))
    heads_out = g.node(f"F_heads{suffix}", (i, *query_heads, e),
                       A[(*query_heads, i, j)] * V[(j, *kv_heads, e)])
    W_O = g.input(f"W_O{suffix}", (*(k.dim for k in query_heads), e.dim, d), role="param",
                  batched=False)
    params.append(W_O)
    out = g.index(d, "o")
    value = heads_out[(i, *query_heads, e)] * W_O[(*query_heads, e, out)]
    if "o" in biased:
        b_O = g.input(f"b_O{suffix}", (d,), role="param", batched=False)
        params.append(b_O)
        value = value + b_O[out]
    F = g.node(out_name, (i, out), value)
    return Attention(F, params, A, _external_shapes(config, params, suffix))


def _external_shapes(config: Config, params: list[Tensor], suffix: str = ""
                     ) -> dict[str, tuple[str, ...]]:
    """The shapes users pass where the engine's differ: heads and rotary chunks are split
    out of the widths ``h·d_k`` (``g·d_k`` for keys with grouped-query attention), ``d``
    (``g·d_v``; ``h·d_k``, ``g·d_k`` with ``value_width = "d_k"``)."""
    if config.heads == 1 and not config.rotary:
        return {}
    key_heads = "g*" if config.kv_heads else "h*" if config.heads > 1 else ""
    query_width = "h*d_k" if config.heads > 1 else "d_k"
    if config.value_width == "d_k":
        value_width, out_width = f"{key_heads}d_k", query_width
    else:
        value_width, out_width = ("g*d_v" if config.kv_heads else "d"), "d"
    shapes = {"W_Q": ("d", query_width), "b_Q": (query_width,),
              "W_K": ("d", f"{key_heads}d_k"), "b_K": (f"{key_heads}d_k",)}
    if config.heads > 1:
        shapes.update({"W_V": ("d", value_width), "b_V": (value_width,),
                       "W_O": (out_width, "d")})
    if config.kv_heads:
        shapes["E_rel"] = ("n_u", "h")
    names = {p.name for p in params}
    return {k + suffix: v for k, v in shapes.items() if k + suffix in names}


def rotary_scaling(config: Config) -> tuple:
    """The rotary table's scaling as the generated code takes it: ``(kind, factor, original
    length, low frequency factor, high frequency factor, beta fast, beta slow, amplitude)``."""
    return (config.rotary_scaling, config.rotary_factor, config.rotary_original_length,
            config.rotary_low_freq_factor, config.rotary_high_freq_factor,
            config.rotary_beta_fast, config.rotary_beta_slow, config.rotary_attention_factor)


def _exactly(value: float) -> sp.Rational:
    """``value`` as a short fraction when one rounds to it (``0.3`` → ``3/10``), else as the
    exact binary fraction it is."""
    short = sp.nsimplify(value, rational=True)
    return short if float(short) == value else sp.Rational(value)


def describe(config: Config, suffix: str = "") -> str:
    """The sublayer as one line of text; its parameters' names and ``F`` end in ``suffix``
    as :func:`self_attention` names them."""
    heads = (f"{config.heads} heads (W_Q, W_K, W_V split by columns, concatenated)"
             if config.heads > 1 else "one head")
    if config.kv_heads:
        heads += (f", {config.kv_heads} key/value heads (query head q uses key/value head "
                  f"q // {config.heads // config.kv_heads})")
    if config.value_width == "d_k":
        heads += ", values of width d_k (W_O maps the heads back to d)"
    bias = {p: f" + b_{p.upper()}" if p in config.attention_bias else "" for p in "qkvo"}
    keyed = "M" if config.cross_attention else "X"
    query, key = f"(X W_Q{bias['q']})", f"({keyed} W_K{bias['k']})"
    values, out = f"({keyed} W_V{bias['v']})", f" W_O{bias['o']}"
    if config.cross_attention:
        heads += (", cross-attention: keys and values from M (L_m × d, the encoder's states, "
                  "a constant input of the call)")
    if config.rotary:
        query, key = f"rot{query}", f"rot{key}"
        turned = ("" if config.rotary_fraction == 1 else
                  f", only the first {config.rotary_fraction:g} of each head's entries turn")
        factor, length = config.rotary_factor, config.rotary_original_length
        scaled = {"none": "", "linear": f", angles / {factor:g} (linear scaling)",
                  "dynamic": f", dynamic NTK scaling (factor {factor:g}, trained length "
                             f"{length})",
                  "llama3": f", Llama 3 scaling (factor {factor:g}, trained length {length})",
                  "yarn": f", YaRN scaling (factor {factor:g}, trained length {length})"
                  }[config.rotary_scaling]
        heads += (f", rotary embeddings rot (rotate-half pairs, angle i * "
                  f"{config.rotary_base:g}^(-2m/d_rot){turned}{scaled})")
    if config.attention_bias.strip("o") or config.rotary:
        scores = f"{query} {key}^T"
    else:
        scores = f"X W_Q W_K^T {keyed}^T"
    if not bias["v"]:
        values = f"{keyed} W_V"
    scale = (f"{config.attention_scale!r} {scores}" if config.attention_scale
             else f"{scores} / sqrt(d_k)")
    if config.relative_bias:
        scale += " + E_rel[bucket(j - i)]"
        heads += (f", T5's relative position bias ({config.relative_buckets} buckets up to "
                  f"distance {config.relative_max_distance}, "
                  + ("keys before the query" if config.causal else "both directions") + ")")
    if config.logit_softcap:
        scale = f"{config.logit_softcap:g} tanh(({scale}) / {config.logit_softcap:g})"
    line = (f"F(X) = softmax({scale}" + (" + causal mask" if config.causal else "")
            + f") {values}" + (out if config.out_proj else "") + f", {heads}")
    if suffix:
        line = re.sub(r"\b([Wb]_[QKVO])\b", rf"\g<1>{suffix}", line.replace("F(X)",
                                                                         f"F{suffix}(X)"))
    return line


def _frequencies(config: Config, half: int, length: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, float]:
    """The angular frequencies of a head's ``half`` rotary pairs and the amplitude of their
    cos and sin, as Hugging Face's rope initialisers define them (``dim = 2·half``)."""
    dim, factor, base = 2 * half, config.rotary_factor, config.rotary_base
    original = config.rotary_original_length
    if config.rotary_scaling == "dynamic":
        seen = max(length, original)
        base = base * ((factor * seen / original) - (factor - 1)) ** (dim / (dim - 2))
    inverse = 1.0 / base ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
    amplitude = 1.0
    if config.rotary_scaling == "linear":
        inverse = inverse / factor
    elif config.rotary_scaling == "llama3":
        low, high = config.rotary_low_freq_factor, config.rotary_high_freq_factor
        wavelength = 2 * math.pi / inverse
        smooth = (original / wavelength - low) / (high - low)
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        inverse = torch.where(wavelength > original / low, inverse / factor,
                              torch.where(medium, (1 - smooth) * inverse / factor
                                          + smooth * inverse, inverse))
    elif config.rotary_scaling == "yarn":
        def dimension(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))
                    / (2 * math.log(base)))
        low = max(math.floor(dimension(config.rotary_beta_fast)), 0)
        high = min(math.ceil(dimension(config.rotary_beta_slow)), dim - 1)
        ramp = ((torch.arange(half, dtype=dtype) - low) / (high - low + 0.001 * (low == high))
                ).clamp(0, 1)
        inverse = inverse / factor * ramp + inverse * (1 - ramp)
        amplitude = config.rotary_attention_factor or (
            0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    return inverse, amplitude


def _buckets(config: Config, L: int) -> torch.Tensor:
    """T5's bucket of each offset ``j - i`` (``L×L`` integers), written as its
    ``_relative_position_bucket``."""
    offset = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    buckets, first = config.relative_buckets, torch.zeros_like(offset)
    if config.causal:
        distance = (-offset).clamp(min=0)
    else:
        buckets //= 2
        first, distance = (offset > 0).long() * buckets, offset.abs()
    exact = buckets // 2
    far = exact + (torch.log(distance.double() / exact)
                   / math.log(config.relative_max_distance / exact)
                   * (buckets - exact)).long()
    far = far.clamp(max=buckets - 1)
    return first + torch.where(distance < exact, distance, far)


def _rotate(x: torch.Tensor, config: Config) -> torch.Tensor:
    """Rotary embeddings of ``x`` (``heads × L × d_k``), rotate-half convention on the first
    ``rotary_fraction · d_k`` entries: entries ``m`` and ``d_rot/2 + m`` of row ``i`` turned by
    ``i · ω_m`` and scaled by the amplitude, the rest left as they are."""
    L, d_k = x.shape[-2:]
    turned = round(d_k * config.rotary_fraction)
    inverse, amplitude = _frequencies(config, turned // 2, L, x.dtype)
    angles = torch.arange(L, dtype=x.dtype)[:, None] * inverse
    angles = torch.cat([angles, angles], dim=-1)
    y, rest = x[..., :turned], x[..., turned:]
    halves = torch.cat([-y[..., turned // 2:], y[..., :turned // 2]], dim=-1)
    y = amplitude * (y * angles.cos() + halves * angles.sin())
    return torch.cat([y, rest], dim=-1)


def reference(config: Config, params: dict, X: torch.Tensor) -> torch.Tensor:
    """The sublayer on one sample ``X`` (``L×d``) in plain PyTorch, parameters in the shapes
    users pass (``W_Q``: ``d × h·d_k``, ``W_K``: ``d × g·d_k``); with ``cross_attention``
    the sample's second input ``params["M"]`` (``L_m×d``)."""
    h, L, d = config.heads, X.shape[0], X.shape[1]
    kv = config.kv_heads or h
    d_k = params["W_Q"].shape[1] // h
    M = params["M"] if config.cross_attention else X
    Q = (X @ params["W_Q"] + params.get("b_Q", 0.0)).reshape(L, h, d_k).transpose(0, 1)
    K = (M @ params["W_K"] + params.get("b_K", 0.0)).reshape(len(M), kv, d_k).transpose(0, 1)
    d_v = d_k if config.value_width == "d_k" else d // h
    V = (M @ params["W_V"] + params.get("b_V", 0.0)).reshape(len(M), kv, d_v).transpose(0, 1)
    if config.rotary:
        Q, K = _rotate(Q, config), _rotate(K, config)
    K, V = K.repeat_interleave(h // kv, 0), V.repeat_interleave(h // kv, 0)
    scores = Q @ K.transpose(1, 2)
    scores = scores * config.attention_scale if config.attention_scale else scores / d_k ** 0.5
    if config.relative_bias:
        E = params["E_rel"].reshape(config.relative_buckets, h)
        scores = scores + E[_buckets(config, L)].permute(2, 0, 1)
    if config.logit_softcap:
        scores = config.logit_softcap * torch.tanh(scores / config.logit_softcap)
    if config.causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ V                   # h × L × d_v
    out = heads.transpose(0, 1).reshape(L, h * d_v)
    return out @ params["W_O"] + params.get("b_O", 0.0) if config.out_proj else out
