"""``curvgap.curvature(model)`` for a ``torch.nn.TransformerEncoder`` of recognised layers
(and its final norm, if any): the chain's exact derivatives (:class:`~curvgap.models.Chain`)
in the model's own parameter order and layout, rows and columns following
``torch.cat([p.reshape(-1) for p in model.parameters()])``."""

from __future__ import annotations

import torch

from ..models import Chain
from .layers import UnsupportedLayer, flat_index
from .recognise import recognise


class ModelCurvature:
    """Exact derivatives of ``model``'s loss (the config's, on its output). ``X`` is
    ``(B, L, d)``; weights are read at every call."""

    def __init__(self, model: torch.nn.TransformerEncoder, loss: str = "mse") -> None:
        self.model = model
        # the parts by their attribute paths: the layers, then the final norm if any
        self.parts = {f"layers.{k}": layer for k, layer in enumerate(model.layers)}
        if model.norm is not None:
            self.parts["norm"] = model.norm
        self.recognised = {prefix: recognise(part, loss) for prefix, part in self.parts.items()}
        first = self.recognised["layers.0"].config
        for prefix, recognised in self.recognised.items():
            if prefix.startswith("layers.") and recognised.config != first:
                raise UnsupportedLayer(f"model.{prefix}: expected the configuration of "
                                       f"model.layers.0, got another")
        self.chain = Chain([(prefix, r.config) for prefix, r in self.recognised.items()])
        index = flat_index(model)
        positions = []  # where each entry of the chain's parameters lives in the model's
        for (prefix, recognised), names_of_part in zip(self.recognised.items(),
                                                       self.chain.part_params):
            mapped = recognised.ours({n: index[f"{prefix}.{n}"] for n in recognised.names})
            positions += [mapped[name].reshape(-1) for name in names_of_part]
        self._back = torch.argsort(torch.cat(positions))

    def params(self) -> dict[str, torch.Tensor]:
        """The chain's parameters, read from the model now."""
        out = {}
        for prefix, part in self.parts.items():
            values = {n: p.detach() for n, p in part.named_parameters()}
            mapped = self.recognised[prefix].ours(values)
            out.update({f"{prefix}.{n}": v.contiguous() for n, v in mapped.items()})
        return out

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """The model's output ``(B, L, d)``."""
        return self.chain.forward(self.params(), X)

    def loss(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the batch (a scalar)."""
        return self.chain.loss(self.params(), X, T)

    def gradient(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss's gradient over every parameter, ``(n,)`` in the model's order."""
        return self.chain.gradient(self.params(), X, T)[self._back]

    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss Hessian over every parameter, ``(n, n)`` in the model's order (the
        cross-layer blocks included)."""
        H = self.chain.loss_hessian(self.params(), X, T)
        return H[self._back][:, self._back]
