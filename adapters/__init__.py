"""Real layers: ``curvature(layer)`` recognises a PyTorch layer, generates its module once
and gives its exact derivatives in the layer's own parameter order and layout."""

from __future__ import annotations

import torch

from .curvature import Curvature
from .layers import UnsupportedLayer


def curvature(layer: torch.nn.Module, loss: str = "mse") -> Curvature:
    """The exact curvature of ``layer`` under ``loss``."""
    return Curvature(layer, loss)


__all__ = ["Curvature", "UnsupportedLayer", "curvature"]
