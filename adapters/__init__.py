"""Real modules: ``curvature(module)`` reads what a PyTorch module computes (a layer, a block
or a whole model: its trace, lowered into the engine), generates its modules once and gives
its exact derivatives in its own parameter order and layout."""

from __future__ import annotations

import torch

from .curvature import Curvature
from .records import UnsupportedLayer, UnsupportedOperation


def curvature(module: torch.nn.Module, loss: str = "mse", fused: bool = False) -> Curvature:
    """The exact curvature of ``module`` under ``loss`` (``fused``: through ``torch.compile``)."""
    return Curvature(module, loss, fused)


__all__ = ["Curvature", "UnsupportedLayer", "UnsupportedOperation", "curvature"]
