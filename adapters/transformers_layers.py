"""Hugging Face transformers layers curvgap recognises: ``GPT2Block`` and
``LlamaDecoderLayer``, and the model ``GPT2Model`` (see :mod:`.layers` for what a recogniser
returns).

Both are taken causal, as their models run them (``GPT2Model`` and ``LlamaModel`` pass a
causal mask; the layer alone has none under the eager attention).
"""

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


def llama_decoder_layer(layer: torch.nn.Module, loss: str) -> Recognised:
    """``LlamaDecoderLayer``: pre-norm with RMSNorm, causal grouped-query attention with
    rotary embeddings (the default RoPE: rotate-half, base ``rope_theta``, positions
    ``0..L-1``), a SwiGLU FFN ``down(act(gate(x)) * up(x))``; ``nn.Linear`` weights, so
    transposed."""
    attention, mlp = layer.self_attn, layer.mlp
    config = attention.config
    refuse_dropout(layer, {"layer.self_attn.attention_dropout": attention.attention_dropout})
    eps = same_eps({"layer.input_layernorm.variance_epsilon":
                    layer.input_layernorm.variance_epsilon,
                    "layer.post_attention_layernorm.variance_epsilon":
                    layer.post_attention_layernorm.variance_epsilon})
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size
    if heads * attention.head_dim != d:
        raise UnsupportedLayer(f"layer.self_attn.head_dim: expected hidden_size / "
                               f"num_attention_heads = {d // heads}, got {attention.head_dim}")
    if attention.scaling != attention.head_dim ** -0.5:
        raise UnsupportedLayer(f"layer.self_attn.scaling: expected head_dim ** -0.5, got "
                               f"{attention.scaling}")
    rope = _rope(config)
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedLayer(f"layer.self_attn.config.rope_parameters: expected the default "
                               f"RoPE, got rope_type {rope['rope_type']!r} (scaled RoPE is not "
                               "represented)")
    bias, ffn_bias = attention.q_proj.bias is not None, mlp.gate_proj.bias is not None
    recognised = validate({
        "name": "llama_layer", "norm": "rmsnorm", "norm_position": "pre", "eps": eps,
        "affine": True, "heads": heads, "kv_heads": kv_heads, "causal": True,
        "out_proj": True, "attention_bias": bias, "rotary": True,
        "rotary_base": float(rope["rope_theta"]),
        "activation": activation_name(mlp.act_fn, "layer.mlp.act_fn"), "ffn_bias": ffn_bias,
        "ffn_gate": True, "loss": loss}, "layer")
    projections = {"W_Q": "self_attn.q_proj", "W_K": "self_attn.k_proj",
                   "W_V": "self_attn.v_proj", "W_O": "self_attn.o_proj",
                   "W_1": "mlp.gate_proj", "W_3": "mlp.up_proj", "W_2": "mlp.down_proj"}

    def ours(v: Values) -> Values:
        out = {}
        for weight, module in projections.items():
            out[weight] = v[f"{module}.weight"].T
            has_bias = ffn_bias if module.startswith("mlp") else bias
            if has_bias:
                out[f"b_{weight[2:]}"] = v[f"{module}.bias"]
        out["gamma_1"] = v["input_layernorm.weight"]
        out["gamma_2"] = v["post_attention_layernorm.weight"]
        return out

    return Recognised(recognised, _names(layer), ours, batch_first=True)


def gpt2_model(model: torch.nn.Module, loss: str) -> RecognisedModel:
    """``GPT2Model`` given ``inputs_embeds`` ``(B, L, d)``: the learned positions ``wpe``
    added (``Z = X + wpe[:L]``), the blocks ``h`` (causal), the final ``ln_f``; its output is
    ``last_hidden_state``. The token embedding ``wte`` is not used on ``inputs_embeds``."""
    from .torch_layers import layer_norm

    refuse_dropout(model, {"model.drop": model.drop.p})
    embedding = validate({"name": "gpt2_positions", "kind": "embedding", "projection": False,
                          "embedding_bias": False, "loss": loss}, "model")

    def positions(v: Values) -> Values:
        return {"P_E": v["wpe.weight"]}

    parts = [("", Recognised(embedding, ("wpe.weight",), positions, batch_first=True,
                             positions=("P_E",)))]
    parts += [(f"h.{k}", gpt2_block(block, loss)) for k, block in enumerate(model.h)]
    parts.append(("ln_f", layer_norm(model.ln_f, loss)))
    return RecognisedModel(tuple(parts))


def _rope(config: object) -> dict:
    """The RoPE settings of a transformers config (``rope_parameters``, or the older
    ``rope_theta`` and ``rope_scaling``)."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        return dict(parameters)
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "rope_theta": config.rope_theta}


def _names(layer: torch.nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in layer.named_parameters())


RECOGNISERS = {("transformers.models.gpt2.modeling_gpt2", "GPT2Block"): gpt2_block,
               ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"):
               llama_decoder_layer}
MODEL_RECOGNISERS = {("transformers.models.gpt2.modeling_gpt2", "GPT2Model"): gpt2_model}
