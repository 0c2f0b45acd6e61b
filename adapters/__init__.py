"""Real layers and models: ``curvature(layer)`` recognises a PyTorch layer (or a whole model:
``torch.nn.TransformerEncoder``, GPT-2's ``GPT2Model``, timm's ``VisionTransformer``),
generates its modules once and gives its exact derivatives in its own parameter order and
layout."""

from __future__ import annotations

import torch

from .curvature import Curvature
from .layers import UnsupportedLayer
from .model_curvature import ModelCurvature
from .recognise import is_model, recognise_model


def curvature(layer: torch.nn.Module, loss: str = "mse") -> Curvature | ModelCurvature:
    """The exact curvature of ``layer`` (or of a whole model) under ``loss``."""
    if is_model(layer):
        return ModelCurvature(layer, recognise_model(layer, loss))
    return Curvature(layer, loss)


__all__ = ["Curvature", "ModelCurvature", "UnsupportedLayer", "curvature"]
