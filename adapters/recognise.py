"""Which recogniser reads a layer: looked up by the layer's exact class, without importing
the library the class comes from."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers import Recognised, UnsupportedLayer
from .timm_layers import RECOGNISERS as TIMM
from .torch_layers import RECOGNISERS as TORCH
from .transformers_layers import RECOGNISERS as TRANSFORMERS

#: The recognisers by ``(module, class name)`` of the layer class they read.
RECOGNISERS: dict[tuple[str, str], Callable[[torch.nn.Module, str], Recognised]] = {
    **TORCH, **TRANSFORMERS, **TIMM}


def recognise(layer: torch.nn.Module, loss: str) -> Recognised:
    """The :class:`Recognised` form of ``layer``, or :class:`UnsupportedLayer` naming what
    it does that curvgap does not represent."""
    cls = type(layer)  # the class itself: a subclass may compute something else
    found = RECOGNISERS.get((cls.__module__, cls.__name__))
    if found is None:
        names = ", ".join(f"{module.split('.')[0]} {name}" for module, name in RECOGNISERS)
        raise UnsupportedLayer(f"layer: expected a layer curvgap recognises ({names}), got "
                               f"{cls.__module__}.{cls.__name__}")
    return found(layer, loss)
