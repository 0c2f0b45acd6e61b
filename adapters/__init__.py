"""Real layers and models: ``curvature(layer)`` recognises a PyTorch layer (or a
``torch.nn.TransformerEncoder`` of recognised layers), generates its module once and gives
its exact derivatives in the layer's own parameter order and layout."""

from __future__ import annotations

import torch

from .curvature import Curvature
from .layers import UnsupportedLayer
from .model_curvature import ModelCurvature


def curvature(layer: torch.nn.Module, loss: str = "mse") -> Curvature | ModelCurvature:
    """The exact curvature of ``layer`` (or of a ``torch.nn.TransformerEncoder``) under
    ``loss``."""
    if type(layer) is torch.nn.TransformerEncoder:
        return ModelCurvature(layer, loss)
    return Curvature(layer, loss)


__all__ = ["Curvature", "ModelCurvature", "UnsupportedLayer", "curvature"]
