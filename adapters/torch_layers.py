"""PyTorch layers curvgap recognises: a layer's config, and its weights as the generated
module's parameters.

Each recognised layer gives its :class:`~curvgap.derivations.config.Config` and a map
``ours(values) -> {parameter: tensor}`` from the layer's parameters (by name) to the
module's; the map only moves entries (transposes, slices), so applied to tensors of indices
it also says where each entry of the module's parameters lives in the layer's
(:mod:`.curvature` uses it to order Hessian rows as the layer's ``parameters()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..derivations.config import Config, validate

Values = dict[str, torch.Tensor]


class UnsupportedLayer(ValueError):
    """The layer does something curvgap does not represent; nothing is approximated."""


@dataclass(frozen=True)
class Recognised:
    """A layer as curvgap sees it: its config, its parameter names in the layer's order,
    and the map of their values to the module's parameters. ``batch_first`` says whether
    the layer itself takes ``(B, L, d)`` (curvgap always does)."""

    config: Config
    names: tuple[str, ...]
    ours: Callable[[Values], Values]
    batch_first: bool


def recognise(layer: torch.nn.Module, loss: str) -> Recognised:
    """The :class:`Recognised` form of ``layer``, or :class:`UnsupportedLayer` naming what
    it does that curvgap does not represent."""
    if isinstance(layer, torch.nn.TransformerEncoderLayer):
        return _encoder_layer(layer, loss)
    raise UnsupportedLayer(f"layer: expected a layer curvgap recognises "
                           f"(torch.nn.TransformerEncoderLayer), got {type(layer).__name__}")


def _encoder_layer(layer: torch.nn.TransformerEncoderLayer, loss: str) -> Recognised:
    attention = layer.self_attn
    if layer.training and any(p > 0 for p in (layer.dropout.p, layer.dropout1.p,
                                              layer.dropout2.p, attention.dropout)):
        raise UnsupportedLayer("layer.dropout: the layer is in training mode with dropout > 0 "
                               "(random); call layer.eval() or set dropout=0")
    if not attention._qkv_same_embed_dim or attention.bias_k is not None:
        raise UnsupportedLayer("layer.self_attn: expected packed in_proj_weight without "
                               "bias_k/bias_v (kdim = vdim = d_model, add_bias_kv=False)")
    activation = _activation(layer.activation)
    eps = (layer.norm1.eps, layer.norm2.eps)
    if eps[0] != eps[1]:
        raise UnsupportedLayer(f"layer.norm2.eps: expected the eps of norm1 ({eps[0]}), got "
                               f"{eps[1]}")
    bias = attention.in_proj_bias is not None
    if (layer.norm1.bias is not None) != bias or (layer.linear1.bias is not None) != bias:
        raise UnsupportedLayer("layer: expected biases everywhere or nowhere (bias=True or "
                               "bias=False)")
    config = validate({
        "name": "encoder_layer", "norm_position": "pre" if layer.norm_first else "post",
        "eps": float(eps[0]), "affine": True, "norm_bias": bias, "heads": attention.num_heads,
        "out_proj": True, "attention_bias": bias, "activation": activation, "ffn_bias": bias,
        "loss": loss}, "layer")
    names = tuple(name for name, _ in layer.named_parameters())
    d = attention.embed_dim

    def ours(v: Values) -> Values:
        out = {}
        for n, name in enumerate("QKV"):
            out[f"W_{name}"] = v["self_attn.in_proj_weight"][n * d:(n + 1) * d].T
            if bias:
                out[f"b_{name}"] = v["self_attn.in_proj_bias"][n * d:(n + 1) * d]
        out["W_O"] = v["self_attn.out_proj.weight"].T
        for k in ("1", "2"):
            out[f"W_{k}"] = v[f"linear{k}.weight"].T
            out[f"gamma_{k}"] = v[f"norm{k}.weight"]
        if bias:
            out["b_O"] = v["self_attn.out_proj.bias"]
            for k in ("1", "2"):
                out[f"b_{k}"] = v[f"linear{k}.bias"]
                out[f"beta_{k}"] = v[f"norm{k}.bias"]
        return out

    return Recognised(config, names, ours, layer.self_attn.batch_first)


def _activation(fn: object) -> str:
    """The config's name of a layer's activation (a function or a module)."""
    if fn is torch.nn.functional.relu or isinstance(fn, torch.nn.ReLU):
        return "relu"
    if fn is torch.nn.functional.gelu:
        return "gelu"
    if isinstance(fn, torch.nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[fn.approximate]
    raise UnsupportedLayer(f"layer.activation: expected relu or gelu, got "
                           f"{getattr(fn, '__name__', type(fn).__name__)}")
