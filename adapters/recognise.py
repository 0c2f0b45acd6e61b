"""Which recogniser reads a layer: looked up by the layer's exact class, without importing
the library the class comes from."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers import Recognised, RecognisedModel, UnsupportedLayer
from .timm_layers import MODEL_RECOGNISERS as TIMM_MODELS
from .timm_layers import RECOGNISERS as TIMM
from .torch_layers import MODEL_RECOGNISERS as TORCH_MODELS
from .torch_layers import RECOGNISERS as TORCH
from .transformers_layers import MODEL_RECOGNISERS as TRANSFORMERS_MODELS
from .transformers_layers import RECOGNISERS as TRANSFORMERS

#: The recognisers by ``(module, class name)`` of the layer class they read.
RECOGNISERS: dict[tuple[str, str], Callable[[torch.nn.Module, str], Recognised]] = {
    **TORCH, **TRANSFORMERS, **TIMM}
#: The model recognisers, likewise.
MODEL_RECOGNISERS: dict[tuple[str, str], Callable[[torch.nn.Module, str], RecognisedModel]] = {
    **TORCH_MODELS, **TRANSFORMERS_MODELS, **TIMM_MODELS}


def is_model(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s exact class is a model curvgap recognises (not a single layer)."""
    cls = type(layer)
    return (cls.__module__, cls.__name__) in MODEL_RECOGNISERS


def recognise_model(model: torch.nn.Module, loss: str) -> RecognisedModel:
    """The :class:`RecognisedModel` form of ``model`` (see :func:`is_model`)."""
    cls = type(model)
    return MODEL_RECOGNISERS[cls.__module__, cls.__name__](model, loss)


def recognise(layer: torch.nn.Module, loss: str) -> Recognised:
    """The :class:`Recognised` form of ``layer``, or :class:`UnsupportedLayer` naming what
    it does that curvgap does not represent."""
    cls = type(layer)  # the class itself: a subclass may compute something else
    found = RECOGNISERS.get((cls.__module__, cls.__name__))
    if found is None:
        names = ", ".join(f"{module.split('.')[0]} {name}"
                          for module, name in [*RECOGNISERS, *MODEL_RECOGNISERS])
        raise UnsupportedLayer(f"layer: expected a layer curvgap recognises ({names}), got "
                               f"{cls.__module__}.{cls.__name__}")
    return found(layer, loss)
