"""PyTorch's own layers curvgap recognises: ``torch.nn.TransformerEncoderLayer`` and
``torch.nn.LayerNorm``, and the model ``torch.nn.TransformerEncoder`` (see :mod:`.layers`
for what a recogniser returns)."""

from __future__ import annotations

import torch

from ..derivations.config import validate
from .layers import (
    Recognised,
    RecognisedModel,
    UnsupportedLayer,
    Values,
    activation_name,
    refuse_dropout,
    same_eps,
)


def encoder_layer(layer: torch.nn.TransformerEncoderLayer, loss: str) -> Recognised:
    """``torch.nn.TransformerEncoderLayer``: post- or pre-LN (``norm_first``), ReLU or GELU,
    with or without biases; ``in_proj_weight`` holds ``W_Q, W_K, W_V`` transposed, stacked."""
    attention = layer.self_attn
    refuse_dropout(layer, {"layer.dropout": layer.dropout.p, "layer.dropout1": layer.dropout1.p,
                           "layer.dropout2": layer.dropout2.p,
                           "layer.self_attn.dropout": attention.dropout})
    if not attention._qkv_same_embed_dim or attention.bias_k is not None:
        raise UnsupportedLayer("layer.self_attn: expected packed in_proj_weight without "
                               "bias_k/bias_v (kdim = vdim = d_model, add_bias_kv=False)")
    activation = activation_name(layer.activation, "layer.activation")
    eps = same_eps({"layer.norm1.eps": layer.norm1.eps, "layer.norm2.eps": layer.norm2.eps})
    bias = attention.in_proj_bias is not None
    if (layer.norm1.bias is not None) != bias or (layer.linear1.bias is not None) != bias:
        raise UnsupportedLayer("layer: expected biases everywhere or nowhere (bias=True or "
                               "bias=False)")
    config = validate({
        "name": "encoder_layer", "norm_position": "pre" if layer.norm_first else "post",
        "eps": eps, "affine": True, "norm_bias": bias, "heads": attention.num_heads,
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


def layer_norm(layer: torch.nn.LayerNorm, loss: str) -> Recognised:
    """``torch.nn.LayerNorm`` over the last axis ``d``, affine (with or without bias)."""
    if len(layer.normalized_shape) != 1 or layer.weight is None:
        raise UnsupportedLayer(f"layer.normalized_shape: expected an affine LayerNorm over the "
                               f"last axis, got normalized_shape {tuple(layer.normalized_shape)}"
                               f" with elementwise_affine={layer.weight is not None}")
    bias = layer.bias is not None
    config = validate({"name": "layer_norm", "kind": "layernorm", "eps": float(layer.eps),
                       "affine": True, "norm_bias": bias, "loss": loss}, "layer")

    def ours(v: Values) -> Values:
        return {"gamma": v["weight"], **({"beta": v["bias"]} if bias else {})}

    return Recognised(config, tuple(n for n, _ in layer.named_parameters()), ours,
                      batch_first=True)


def transformer_encoder(model: torch.nn.TransformerEncoder, loss: str) -> RecognisedModel:
    """``torch.nn.TransformerEncoder``: its ``layers`` (encoder layers of one configuration)
    and its final ``norm``, if any."""
    parts = [(f"layers.{k}", encoder_layer(layer, loss)) for k, layer in enumerate(model.layers)]
    if model.norm is not None:
        if type(model.norm) is not torch.nn.LayerNorm:
            raise UnsupportedLayer(f"model.norm: expected a LayerNorm, got "
                                   f"{type(model.norm).__name__}")
        parts.append(("norm", layer_norm(model.norm, loss)))
    return RecognisedModel(tuple(parts))


RECOGNISERS = {("torch.nn.modules.transformer", "TransformerEncoderLayer"): encoder_layer,
               ("torch.nn.modules.normalization", "LayerNorm"): layer_norm}
MODEL_RECOGNISERS = {("torch.nn.modules.transformer", "TransformerEncoder"):
                     transformer_encoder}
