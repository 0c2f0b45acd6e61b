"""``curvgap.curvature(model)`` for a stack of recognised layers
(``torch.nn.TransformerEncoder`` without a final norm): the stack's exact derivatives
(:class:`~curvgap.models.Stack`) in the model's own parameter order and layout, rows and
columns following ``torch.cat([p.reshape(-1) for p in model.parameters()])``."""

from __future__ import annotations

import torch

from ..models import Stack
from .layers import UnsupportedLayer
from .recognise import recognise


class ModelCurvature:
    """Exact derivatives of ``model``'s loss (the config's, on its output). ``X`` is
    ``(B, L, d)``; weights are read at every call."""

    def __init__(self, model: torch.nn.TransformerEncoder, loss: str = "mse") -> None:
        if model.norm is not None:
            raise UnsupportedLayer("model.norm: a final norm after the layers is not "
                                   "represented yet; pass norm=None")
        self.model, self.layers = model, list(model.layers)
        self.recognised = [recognise(layer, loss) for layer in self.layers]
        for k, recognised in enumerate(self.recognised[1:], start=1):
            if recognised.config != self.recognised[0].config:
                raise UnsupportedLayer(f"model.layers.{k}: expected the configuration of "
                                       f"model.layers.0, got another")
        self.stack = Stack(self.recognised[0].config, len(self.layers))
        self.names = [name for name, _ in model.named_parameters()]
        shapes = dict(model.named_parameters())
        sizes = [shapes[n].numel() for n in self.names]
        offsets = dict(zip(self.names, (sum(sizes[:k]) for k in range(len(sizes)))))
        positions = []  # where each entry of the stack's parameters lives in the model's
        for k, recognised in enumerate(self.recognised):
            index = {n: torch.arange(offsets[f"layers.{k}.{n}"],
                                     offsets[f"layers.{k}.{n}"] + shapes[f"layers.{k}.{n}"].numel()
                                     ).reshape(shapes[f"layers.{k}.{n}"].shape)
                     for n in recognised.names}
            mapped = recognised.ours(index)
            positions += [mapped[name].reshape(-1) for name in self.stack.block_params]
        self._back = torch.argsort(torch.cat(positions))

    def params(self) -> dict[str, torch.Tensor]:
        """The stack's parameters, read from the model now."""
        out = {}
        for k, (layer, recognised) in enumerate(zip(self.layers, self.recognised)):
            values = {n: p.detach() for n, p in layer.named_parameters()}
            out.update({f"{k}.{n}": v.contiguous() for n, v in recognised.ours(values).items()})
        return out

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """The model's output ``(B, L, d)``."""
        return self.stack.forward(self.params(), X)

    def loss(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the batch (a scalar)."""
        return self.stack.loss(self.params(), X, T)

    def gradient(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss's gradient over every parameter, ``(n,)`` in the model's order."""
        return self.stack.gradient(self.params(), X, T)[self._back]

    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss Hessian over every parameter, ``(n, n)`` in the model's order (the
        cross-layer blocks included)."""
        H = self.stack.loss_hessian(self.params(), X, T)
        return H[self._back][:, self._back]
