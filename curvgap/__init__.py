"""curvgap: exact Jacobians, Hessians and Hessian-vector products of Transformer layers.

``curvgap.curvature(layer, loss="mse")`` gives them for a PyTorch layer it recognises, in
the layer's own parameter order and layout (:mod:`curvgap.adapters`); the generated modules
are in ``curvgap.generated.numpy`` and ``curvgap.generated.torch``.
"""

from __future__ import annotations

from typing import Any


def curvature(layer: Any, loss: str = "mse") -> Any:
    """The exact curvature of ``layer`` under ``loss`` (:class:`~curvgap.adapters.Curvature`)."""
    from .adapters import curvature as make

    return make(layer, loss)
