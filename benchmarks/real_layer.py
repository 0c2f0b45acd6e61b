"""The real-layer case of ``curvgap bench``: ``curvgap.curvature`` on a
``torch.nn.TransformerEncoderLayer`` against the autograd routes that are correct on it
(reverse over reverse with the MATH attention kernel; ``torch.func.hessian`` is not, through
``F.layer_norm``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..adapters import curvature


def encoder_layer(d: int, heads: int, d_ff: int, seed: int = 0) -> torch.nn.Module:
    """A pre-LN GELU encoder layer with biases, random nonzero weights, float64, eval mode."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d, heads, d_ff, activation="gelu",
                                             batch_first=True, norm_first=True,
                                             dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (0.5 if p.ndim == 1 else 0.0))
    return layer.eval()


class LayerRoutes:
    """Routes to the loss Hessian and an HVP of ``F.mse_loss(layer(X), T)``."""

    def __init__(self, layer: torch.nn.Module, X: torch.Tensor, T: torch.Tensor) -> None:
        self.layer, self.X, self.T = layer, X, T
        self.params = list(layer.parameters())
        self.n = sum(p.numel() for p in self.params)
        self.v = torch.randn(self.n, generator=torch.Generator().manual_seed(1),
                             dtype=X.dtype)
        self.curvature = curvature(layer)

    def _gradient(self) -> torch.Tensor:
        loss = F.mse_loss(self.layer(self.X), self.T)
        grads = torch.autograd.grad(loss, self.params, create_graph=True)
        return torch.cat([g.reshape(-1) for g in grads])

    def hessian_rows(self) -> Callable:
        """Reverse over reverse, all rows in one batched backward pass."""
        def run():
            with sdpa_kernel(SDPBackend.MATH):
                rows = torch.autograd.grad(self._gradient(), self.params,
                                           torch.eye(self.n, dtype=self.X.dtype),
                                           is_grads_batched=True)
            return torch.cat([r.reshape(self.n, -1) for r in rows], dim=1)
        return run

    def hvp_double_backward(self) -> Callable:
        def run():
            with sdpa_kernel(SDPBackend.MATH):
                rows = torch.autograd.grad(self._gradient() @ self.v, self.params)
            return torch.cat([r.reshape(-1) for r in rows])
        return run

    def curvgap_hessian(self) -> Callable:
        return lambda: self.curvature.loss_hessian(self.X, self.T)

    def curvgap_hvp(self) -> Callable:
        return lambda: self.curvature.hvp(self.X, self.T, self.v)


def agreement(routes: LayerRoutes) -> dict[str, float]:
    """Max relative difference of curvgap's Hessian and HVP from reverse over reverse."""
    reference = routes.hessian_rows()()
    hvp = routes.curvgap_hvp()()
    return {"loss_hessian": float((routes.curvgap_hessian()() - reference).abs().max()
                                  / reference.abs().max()),
            "hvp": float((hvp - reference @ routes.v).abs().max()
                         / (reference @ routes.v).abs().max())}
