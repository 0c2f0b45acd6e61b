"""The depth case of ``curvgap bench``: ``curvgap.curvature`` on a
``torch.nn.TransformerEncoder`` of ``N`` layers against autograd on the model itself, for
``N = 1, 2, 4, 8, 12`` — the gradient, the HVP, a cross-layer Hessian block (the first
layer's ``linear1`` with the last layer's ``linear2``) and the full loss Hessian (reverse over
reverse, every row in one batched pass, while its rows fit in memory)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .real_layer import LayerRoutes, encoder_layer


def encoder(depth: int, d: int, heads: int, d_ff: int) -> torch.nn.TransformerEncoder:
    """``depth`` pre-LN GELU encoder layers with biases, random nonzero weights, float64."""
    model = torch.nn.TransformerEncoder(encoder_layer(d, heads, d_ff), depth,
                                        enable_nested_tensor=False)
    torch.manual_seed(depth)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (0.5 if p.ndim == 1 else 0.0))
    return model.eval()


class DepthRoutes(LayerRoutes):
    """:class:`LayerRoutes` on a whole model, with the gradient and a cross-layer block."""

    def __init__(self, model: torch.nn.TransformerEncoder, X: torch.Tensor,
                 T: torch.Tensor) -> None:
        super().__init__(model, X, T)
        last = len(model.layers) - 1
        self.wrt = ["layers.0.linear1.weight", f"layers.{last}.linear2.weight"]
        slices = self.curvature.layer_slices()
        self.block = torch.cat([torch.arange(slices[n].start, slices[n].stop)
                                for n in self.wrt])

    def gradient_backward(self) -> Callable:
        def run():
            with sdpa_kernel(SDPBackend.MATH):
                loss = F.mse_loss(self.layer(self.X), self.T)
                return torch.autograd.grad(loss, self.params)
        return run

    def curvgap_gradient(self) -> Callable:
        return lambda: self.curvature.gradient(self.X, self.T)

    def block_rows(self) -> Callable:
        """Reverse over reverse, the block's rows in one batched pass (its columns kept)."""
        def run():
            with sdpa_kernel(SDPBackend.MATH):
                seeds = torch.eye(self.n, dtype=self.X.dtype)[self.block]
                rows = torch.autograd.grad(self._gradient(), self.params, seeds,
                                           is_grads_batched=True)
            return torch.cat([r.reshape(len(self.block), -1) for r in rows], 1)[:, self.block]
        return run

    def curvgap_block(self) -> Callable:
        return lambda: self.curvature.loss_hessian(self.X, self.T, wrt=self.wrt)
