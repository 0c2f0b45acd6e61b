"""What a recogniser of a real layer returns, and the checks recognisers share.

A recogniser reads a layer and gives its :class:`~curvgap.derivations.config.Config` and a
map ``ours(values) -> {parameter: tensor}`` from the layer's parameters (by name) to the
module's; the map only moves entries (transposes, slices), so applied to tensors of indices
it also says where each entry of the module's parameters lives in the layer's
(:mod:`.curvature` uses it to order Hessian rows as the layer's ``parameters()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..derivations.config import Config

Values = dict[str, torch.Tensor]


class UnsupportedLayer(ValueError):
    """The layer does something curvgap does not represent; nothing is approximated."""


@dataclass(frozen=True)
class Recognised:
    """A layer as curvgap sees it: its config, its parameter names in the layer's order,
    and the map of their values to the module's parameters. ``batch_first`` says whether
    the layer itself takes ``(B, L, d)`` (curvgap always does); ``positions`` names the
    module's parameters that are tables over positions (a learned positional embedding
    longer than the input), whose first axis is cut to the input's length ``L``."""

    config: Config
    names: tuple[str, ...]
    ours: Callable[[Values], Values]
    batch_first: bool
    positions: tuple[str, ...] = ()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class RecognisedModel:
    """A model as a chain of recognised parts, in order: each part's prefix (its attribute
    path in the model; ``""`` for parameters the model holds itself, such as a class token)
    and its :class:`Recognised` form, with names relative to that prefix. ``inputs``,
    ``targets`` and ``outputs`` relate the model's own input, target and output to the
    chain's (reshapes only: images to patches, labels to one row)."""

    parts: tuple[tuple[str, Recognised], ...]
    inputs: Callable[[torch.Tensor], torch.Tensor] = field(default=_same)
    targets: Callable[[torch.Tensor], torch.Tensor] = field(default=_same)
    outputs: Callable[[torch.Tensor], torch.Tensor] = field(default=_same)

    @property
    def takes_rows(self) -> bool:
        """Whether the model takes the chain's input as it is (rows ``(B, L, d)``)."""
        return self.inputs is _same


def flat_index(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per parameter name, the positions of its entries (shaped as the parameter) in
    ``torch.cat([p.reshape(-1) for p in module.parameters()])``."""
    index, offset = {}, 0
    for name, parameter in module.named_parameters():
        index[name] = torch.arange(offset, offset + parameter.numel()).reshape(parameter.shape)
        offset += parameter.numel()
    return index


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
