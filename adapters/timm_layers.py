"""timm layers curvgap recognises: the ViT ``Block`` (see :mod:`.layers` for what a
recogniser returns). The block is taken as it runs in a ViT: no attention mask, not causal.
"""

from __future__ import annotations

import torch

from ..derivations.config import validate
from .layers import (
    Recognised,
    UnsupportedLayer,
    Values,
    activation_name,
    refuse_dropout,
    same_eps,
)


def vit_block(layer: torch.nn.Module, loss: str) -> Recognised:
    """timm's ViT ``Block``: pre-LN, multi-head attention whose ``qkv`` ``nn.Linear`` holds
    ``W_Q, W_K, W_V`` transposed and stacked, an ``Mlp`` of ``fc1, act, fc2``."""
    attention, mlp = layer.attn, layer.mlp
    for name, module in {"layer.ls1": layer.ls1, "layer.ls2": layer.ls2,
                         "layer.attn.q_norm": attention.q_norm,
                         "layer.attn.k_norm": attention.k_norm,
                         "layer.attn.norm": attention.norm, "layer.mlp.norm": mlp.norm}.items():
        if not isinstance(module, torch.nn.Identity):
            raise UnsupportedLayer(f"{name}: expected Identity, got {type(module).__name__} "
                                   "(LayerScale, qk-norm and extra norms are not represented)")
    if getattr(attention, "gate", None) is not None:
        raise UnsupportedLayer("layer.attn.gate: gated attention is not represented")
    refuse_dropout(layer, {
        "layer.attn.attn_drop": attention.attn_drop.p, "layer.attn.proj_drop":
        attention.proj_drop.p, "layer.mlp.drop1": mlp.drop1.p, "layer.mlp.drop2": mlp.drop2.p,
        "layer.drop_path1": getattr(layer.drop_path1, "drop_prob", 0.0),
        "layer.drop_path2": getattr(layer.drop_path2, "drop_prob", 0.0)})
    for name, norm in {"layer.norm1": layer.norm1, "layer.norm2": layer.norm2}.items():
        if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is None:
            raise UnsupportedLayer(f"{name}: expected an affine LayerNorm, got "
                                   f"{type(norm).__name__}")
    eps = same_eps({"layer.norm1.eps": layer.norm1.eps, "layer.norm2.eps": layer.norm2.eps})
    d, heads = layer.norm1.normalized_shape[0], attention.num_heads
    if attention.attn_dim != d or attention.proj.out_features != d:
        raise UnsupportedLayer(f"layer.attn.head_dim: expected dim / num_heads = {d // heads} "
                               f"and an output of width {d}, got head_dim "
                               f"{attention.head_dim}")
    biases = {"layer.attn.qkv.bias": attention.qkv.bias, "layer.attn.proj.bias":
              attention.proj.bias, "layer.mlp.fc1.bias": mlp.fc1.bias,
              "layer.mlp.fc2.bias": mlp.fc2.bias, "layer.norm1.bias": layer.norm1.bias}
    bias = attention.qkv.bias is not None
    mismatched = [name for name, value in biases.items() if (value is not None) != bias]
    if mismatched:
        raise UnsupportedLayer(f"{mismatched[0]}: expected biases everywhere or nowhere "
                               f"(qkv_bias = proj_bias), got qkv bias {bias}")
    config = validate({
        "name": "vit_block", "norm_position": "pre", "eps": eps, "affine": True,
        "norm_bias": bias, "heads": heads, "out_proj": True, "attention_bias": bias,
        "activation": activation_name(mlp.act, "layer.mlp.act"), "ffn_bias": bias,
        "loss": loss}, "layer")

    def ours(v: Values) -> Values:
        out = {}
        for n, name in enumerate("QKV"):
            out[f"W_{name}"] = v["attn.qkv.weight"][n * d:(n + 1) * d].T
            if bias:
                out[f"b_{name}"] = v["attn.qkv.bias"][n * d:(n + 1) * d]
        out["W_O"] = v["attn.proj.weight"].T
        for k in ("1", "2"):
            out[f"W_{k}"] = v[f"mlp.fc{k}.weight"].T
            out[f"gamma_{k}"] = v[f"norm{k}.weight"]
            if bias:
                out[f"b_{k}"] = v[f"mlp.fc{k}.bias"]
                out[f"beta_{k}"] = v[f"norm{k}.bias"]
        if bias:
            out["b_O"] = v["attn.proj.bias"]
        return out

    return Recognised(config, tuple(n for n, _ in layer.named_parameters()), ours,
                      batch_first=True)


RECOGNISERS = {("timm.models.vision_transformer", "Block"): vit_block}
