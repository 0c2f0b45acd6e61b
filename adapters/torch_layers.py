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


def _recognisers() -> dict[tuple[str, str], Callable[[torch.nn.Module, str], Recognised]]:
    """The recognisers by ``(module, class name)`` of the layer class they read (looked up
    without importing the library the class comes from)."""
    from . import timm_layers, transformers_layers

    return {("torch.nn.modules.transformer", "TransformerEncoderLayer"): encoder_layer,
            **transformers_layers.RECOGNISERS, **timm_layers.RECOGNISERS}


def recognise(layer: torch.nn.Module, loss: str) -> Recognised:
    """The :class:`Recognised` form of ``layer``, or :class:`UnsupportedLayer` naming what
    it does that curvgap does not represent."""
    recognisers = _recognisers()
    cls = type(layer)  # the class itself: a subclass may compute something else
    found = recognisers.get((cls.__module__, cls.__name__))
    if found is None:
        names = ", ".join(f"{module.split('.')[0]} {name}" for module, name in recognisers)
        raise UnsupportedLayer(f"layer: expected a layer curvgap recognises ({names}), got "
                               f"{cls.__module__}.{cls.__name__}")
    return found(layer, loss)


def refuse_dropout(layer: torch.nn.Module, rates: dict[str, float]) -> None:
    """:class:`UnsupportedLayer` when ``layer`` trains with a dropout rate (by attribute
    name) above zero: dropout is random, not a function of the weights."""
    if layer.training:
        for name, rate in rates.items():
            if rate > 0:
                raise UnsupportedLayer(f"{name}: the layer is in training mode with dropout "
                                       f"{rate} > 0 (random); call layer.eval() or set it to 0")


def same_eps(norms: dict[str, float]) -> float:
    """The one ``eps`` of the layer's norms (by attribute name), or :class:`UnsupportedLayer`."""
    (first, eps), *others = norms.items()
    for name, value in others:
        if value != eps:
            raise UnsupportedLayer(f"{name}: expected the eps of {first} ({eps}), got {value}")
    return float(eps)


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


#: Activation modules by ``(module, class name)``: the config's name of what they compute.
ACTIVATIONS = {
    ("torch.nn.modules.activation", "ReLU"): "relu",
    ("torch.nn.modules.activation", "SiLU"): "silu",
    ("torch.nn.modules.activation", "Tanh"): "tanh",
    ("torch.nn.modules.activation", "Sigmoid"): "sigmoid",
    ("transformers.activations", "GELUActivation"): "gelu",
    ("transformers.activations", "NewGELUActivation"): "gelu_tanh",
    ("transformers.activations", "GELUTanh"): "gelu_tanh",
    ("transformers.activations", "SiLUActivation"): "silu",
}
#: Activation functions (not modules) and their config names.
FUNCTIONS = {torch.nn.functional.relu: "relu", torch.nn.functional.gelu: "gelu",
             torch.nn.functional.silu: "silu"}


def activation_name(fn: object, attribute: str) -> str:
    """The config's name of the activation ``fn`` (a function or a module) found at
    ``attribute``, or :class:`UnsupportedLayer`."""
    if isinstance(fn, torch.nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[fn.approximate]
    name = ACTIVATIONS.get((type(fn).__module__, type(fn).__name__))
    if name is None and callable(fn) and not isinstance(fn, torch.nn.Module):
        name = FUNCTIONS.get(fn)
    if name is None:
        raise UnsupportedLayer(f"{attribute}: expected one of ReLU, GELU (erf or tanh), SiLU, "
                               f"Tanh, Sigmoid, got "
                               f"{getattr(fn, '__name__', type(fn).__name__)}")
    return name
