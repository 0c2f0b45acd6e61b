"""Hugging Face transformers layers curvgap recognises: ``GPT2Block`` and
``LlamaDecoderLayer`` (see :mod:`.torch_layers` for what a recogniser returns).

Both are taken causal, as their models run them (``GPT2Model`` and ``LlamaModel`` pass a
causal mask; the layer alone has none under the eager attention).
"""

from __future__ import annotations

import torch

from ..derivations.config import validate
from .torch_layers import (
    Recognised,
    UnsupportedLayer,
    Values,
    activation_name,
    refuse_dropout,
    same_eps,
)


def gpt2_block(layer: torch.nn.Module, loss: str) -> Recognised:
    """``GPT2Block``: pre-LN, affine LayerNorm, causal multi-head attention whose ``Conv1D``
    ``c_attn`` holds ``[W_Q | W_K | W_V]`` untransposed (``d × 3d``, ``y = x W + b``), an
    FFN of ``Conv1D`` layers."""
    attention, mlp = layer.attn, layer.mlp
    if hasattr(layer, "crossattention"):
        raise UnsupportedLayer("layer.crossattention: cross-attention "
                               "(add_cross_attention=True) is not represented")
    refuse_dropout(layer, {"layer.attn.attn_dropout": attention.attn_dropout.p,
                           "layer.attn.resid_dropout": attention.resid_dropout.p,
                           "layer.mlp.dropout": mlp.dropout.p})
    eps = same_eps({"layer.ln_1.eps": layer.ln_1.eps, "layer.ln_2.eps": layer.ln_2.eps})
    d, heads = attention.embed_dim, attention.num_heads
    default_scale = attention.scale_attn_weights and not attention.scale_attn_by_inverse_layer_idx
    config = validate({
        "name": "gpt2_layer", "norm_position": "pre", "eps": eps, "affine": True,
        "heads": heads, "causal": True, "out_proj": True, "attention_bias": True,
        "attention_scale": 0.0 if default_scale else float(attention.scaling),
        "activation": activation_name(mlp.act, "layer.mlp.act"), "ffn_bias": True,
        "loss": loss}, "layer")

    def ours(v: Values) -> Values:
        out = {}
        for n, name in enumerate("QKV"):
            out[f"W_{name}"] = v["attn.c_attn.weight"][:, n * d:(n + 1) * d]
            out[f"b_{name}"] = v["attn.c_attn.bias"][n * d:(n + 1) * d]
        out["W_O"], out["b_O"] = v["attn.c_proj.weight"], v["attn.c_proj.bias"]
        out["W_1"], out["b_1"] = v["mlp.c_fc.weight"], v["mlp.c_fc.bias"]
        out["W_2"], out["b_2"] = v["mlp.c_proj.weight"], v["mlp.c_proj.bias"]
        for k in ("1", "2"):
            out[f"gamma_{k}"], out[f"beta_{k}"] = v[f"ln_{k}.weight"], v[f"ln_{k}.bias"]
        return out

    return Recognised(config, _names(layer), ours, batch_first=True)


def _names(layer: torch.nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in layer.named_parameters())


RECOGNISERS = {("transformers.models.gpt2.modeling_gpt2", "GPT2Block"): gpt2_block}
