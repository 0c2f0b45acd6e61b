"""timm layers curvgap recognises: the ViT ``Block``, and the model ``VisionTransformer``
(see :mod:`.layers` for what a recogniser returns). The block is taken as it runs in a ViT:
no attention mask, not causal.
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


def vision_transformer(model: torch.nn.Module, loss: str) -> RecognisedModel:
    """timm's ``VisionTransformer`` on images ``(B, C, H, W)`` of its ``img_size``: the
    patch embedding (a ``Conv2d`` whose kernel is its stride, read as ``W_E`` over each
    patch's ``C·p_h·p_w`` pixels in the convolution's order), the class token and learned
    positions, an optional ``norm_pre``, the blocks, the final ``norm``, and the linear
    ``head`` on the class token (``global_pool="token"``) or on the mean of the tokens
    (``"avg"``, without a class token). The logits are ``(B, num_classes)``; the
    cross-entropy target is the labels ``(B,)``."""
    from .torch_layers import layer_norm

    embed = model.patch_embed
    proj = embed.proj
    if (type(embed).__module__, type(embed).__name__) != ("timm.layers.patch_embed",
                                                          "PatchEmbed"):
        raise UnsupportedLayer(f"model.patch_embed: expected timm's PatchEmbed, got "
                               f"{type(embed).__name__}")
    if (not isinstance(proj, torch.nn.Conv2d) or proj.kernel_size != proj.stride
            or proj.padding != (0, 0) or proj.dilation != (1, 1) or proj.groups != 1
            or not embed.flatten or embed.dynamic_img_pad or embed.img_size is None
            or not isinstance(embed.norm, torch.nn.Identity)):
        raise UnsupportedLayer("model.patch_embed: expected non-overlapping patches of a fixed "
                               "image size (a Conv2d with kernel = stride, no padding, no "
                               "norm), flattened")
    checks = {"model.reg_token": model.reg_token is None,
              "model.no_embed_class": not model.no_embed_class,
              "model.pos_embed": model.pos_embed is not None,
              "model.dynamic_img_size": not model.dynamic_img_size,
              "model.patch_drop": isinstance(model.patch_drop, torch.nn.Identity),
              "model.attn_pool": model.attn_pool is None,
              "model.fc_norm": isinstance(model.fc_norm, torch.nn.Identity),
              "model.head": isinstance(model.head, torch.nn.Linear)}
    for name, ok in checks.items():
        if not ok:
            raise UnsupportedLayer(f"{name}: expected the plain ViT's (no register tokens, "
                                   f"positions over the class token, fixed image size, no "
                                   f"patch dropout or attention pooling, no fc_norm, a "
                                   f"Linear head), got {getattr(model, name[6:])!r}")
    token = model.cls_token is not None
    pooling = {("token", True): "first", ("avg", False): "mean"}.get((model.global_pool, token))
    if pooling is None:
        raise UnsupportedLayer(f"model.global_pool: expected 'token' with a class token or "
                               f"'avg' without one, got {model.global_pool!r} with "
                               f"class_token={token}")
    refuse_dropout(model, {"model.pos_drop": model.pos_drop.p, "model.head_drop":
                           model.head_drop.p})
    d, bias = model.embed_dim, proj.bias is not None
    embedding = validate({"name": "vit_embedding", "kind": "embedding",
                          "embedding_bias": bias, "class_token": token, "loss": loss}, "model")
    names = ("patch_embed.proj.weight", *(("patch_embed.proj.bias",) if bias else ()),
             *(("cls_token",) if token else ()), "pos_embed")

    def embedded(v: Values) -> Values:
        out = {"W_E": v["patch_embed.proj.weight"].reshape(d, -1).T}
        if bias:
            out["b_E"] = v["patch_embed.proj.bias"]
        if token:
            out["c_E"] = v["cls_token"].reshape(d)
        out["P_E"] = v["pos_embed"].reshape(-1, d)
        return out

    parts = [("", Recognised(embedding, names, embedded, batch_first=True))]
    for prefix, norm in (("norm_pre", model.norm_pre),):
        if not isinstance(norm, torch.nn.Identity):
            parts.append((prefix, layer_norm(norm, loss)))
    parts += [(f"blocks.{k}", vit_block(block, loss)) for k, block in enumerate(model.blocks)]
    if not isinstance(model.norm, torch.nn.Identity):
        parts.append(("norm", layer_norm(model.norm, loss)))
    head_bias = model.head.bias is not None
    head = validate({"name": "vit_head", "kind": "head", "pooling": pooling,
                     "head_bias": head_bias, "loss": loss}, "model")

    def classifier(v: Values) -> Values:
        return {"W_H": v["weight"].T, **({"b_H": v["bias"]} if head_bias else {})}

    parts.append(("head", Recognised(head, ("weight", *(("bias",) if head_bias else ())),
                                     classifier, batch_first=True)))
    channels, (height, width) = proj.in_channels, embed.img_size
    (ph, pw) = proj.kernel_size

    def patches(images: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, H, W)`` as rows of patches ``(B, N, C·p_h·p_w)`` (a placeholder
        row of zeros first where the class token goes)."""
        if images.ndim != 4 or tuple(images.shape[1:]) != (channels, height, width):
            raise ValueError(f"X: expected images of shape (B, {channels}, {height}, {width}), "
                             f"got shape {tuple(images.shape)}")
        b = images.shape[0]
        rows = (images.reshape(b, channels, height // ph, ph, width // pw, pw)
                .permute(0, 2, 4, 1, 3, 5).reshape(b, -1, channels * ph * pw))
        return torch.cat([rows.new_zeros(b, 1, rows.shape[-1]), rows], 1) if token else rows

    def targets(T: torch.Tensor) -> torch.Tensor:
        return T[:, None]  # one row: labels (B,) → (B, 1); logits (B, c) → (B, 1, c)

    def logits(Z: torch.Tensor) -> torch.Tensor:
        return Z[:, 0]

    return RecognisedModel(tuple(parts), patches, targets, logits)


RECOGNISERS = {("timm.models.vision_transformer", "Block"): vit_block}
MODEL_RECOGNISERS = {("timm.models.vision_transformer", "VisionTransformer"):
                     vision_transformer}
