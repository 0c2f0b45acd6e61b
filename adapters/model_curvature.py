"""``curvgap.curvature(model)`` for a whole model (``torch.nn.TransformerEncoder``, GPT-2's
``GPT2Model``, timm's ``VisionTransformer``): the exact derivatives of the chain of its
recognised parts (:class:`~curvgap.models.Chain`) in the model's own parameter order and
layout.

Rows and columns of Hessians and entries of gradients and HVPs follow
``torch.cat([p.reshape(-1) for p in model.parameters()])`` (or, with ``wrt``, the model's
named parameters listed, in the model's order). Entries the loss does not depend on are
exactly zero: GPT-2's token embedding ``wte`` when the model is given ``inputs_embeds``, and
the rows of a positional table past the input's length.

In place of ``X, T``, the averaging functions and ``hessian_operator`` take a dataset's
batches, as for a single layer (:mod:`curvgap.data`).
"""

from __future__ import annotations

import torch

from ..data import is_batches, over_batches, takes_batches
from ..models import Chain
from ..operators.hessian import CurvatureOperator, part_product
from .layers import RecognisedModel, UnsupportedLayer, flat_index


class ModelCurvature:
    """Exact derivatives of ``model``'s loss (the config's, on its output). ``X`` is what
    the model takes (``(B, L, d)``; images ``(B, C, H, W)`` for a ViT); weights are read at
    every call."""

    def __init__(self, model: torch.nn.Module, recognised: RecognisedModel) -> None:
        self.model, self.recognised = model, recognised
        blocks = [(prefix, part) for prefix, part in recognised.parts
                  if prefix.split(".")[-1].isdigit()]
        for prefix, part in blocks[1:]:
            if part.config != blocks[0][1].config:
                raise UnsupportedLayer(f"model.{prefix}: expected the configuration of "
                                       f"model.{blocks[0][0]}, got another")
        self.chain = Chain([(prefix or "embedding", part.config)
                            for prefix, part in recognised.parts])
        self.names = [name for name, _ in model.named_parameters()]
        self._index = flat_index(model)
        self._layouts: dict[int, tuple[torch.Tensor, dict[str, slice]]] = {}

    @staticmethod
    def _full(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    def _ours(self, values: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        """The chain's parameters from the model's ``values`` (by name), position tables cut
        to ``length`` rows."""
        out = {}
        for (prefix, part), names in zip(self.recognised.parts, self.chain.part_params):
            mapped = part.ours({n: values[self._full(prefix, n)] for n in part.names})
            for name in names:
                value = mapped[name]
                if name in part.positions:
                    if value.shape[0] < length:
                        raise ValueError(f"X: expected at most {value.shape[0]} positions (the "
                                         f"rows of the model's positional table), got "
                                         f"{length}")
                    value = value[:length]
                out[f"{prefix or 'embedding'}.{name}"] = value
        return out

    def _layout(self, length: int) -> tuple[torch.Tensor, dict[str, slice]]:
        """Where each entry of the chain's parameters lives in the model's flat vector (their
        concatenation in ``PARAMS`` order), and each parameter's span of that
        concatenation."""
        if length not in self._layouts:
            index = self._ours(self._index, length)
            spans, offset = {}, 0
            for name in self.chain.PARAMS:
                spans[name] = slice(offset, offset + index[name].numel())
                offset += index[name].numel()
            positions = torch.cat([index[n].reshape(-1) for n in self.chain.PARAMS])
            self._layouts[length] = positions, spans
        return self._layouts[length]

    def params(self, length: int) -> dict[str, torch.Tensor]:
        """The chain's parameters, read from the model now, for inputs of ``length`` rows."""
        values = {n: p.detach() for n, p in self.model.named_parameters()}
        return {n: v.contiguous() for n, v in self._ours(values, length).items()}

    def _names(self, wrt: str | list[str] | None) -> list[str]:
        """The model's parameters ``wrt`` names (default: all), checked."""
        names = self.names if wrt is None else [wrt] if isinstance(wrt, str) else list(wrt)
        unknown = [n for n in names if n not in self.names]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(f"wrt: expected distinct names of the model's parameters (such "
                             f"as {self.names[0]!r}), got {names}")
        return names

    def _selection(self, wrt: str | list[str] | None, length: int
                   ) -> tuple[list[str], list[slice], torch.Tensor, int]:
        """For the model's parameters ``wrt``: the chain's parameters that hold them, their
        spans in the chain's concatenation, where each of their entries goes among the
        ``wrt`` parameters' entries in the model's order (``-1``: not in ``wrt``), and how
        many entries ``wrt`` has."""
        names = self._names(wrt)
        rank = torch.full((sum(p.numel() for p in self.model.parameters()),), -1)
        count = 0
        for name in self.names:  # the model's order
            if name in names:
                entries = self._index[name].reshape(-1)
                rank[entries] = torch.arange(count, count + entries.numel())
                count += entries.numel()
        positions, spans = self._layout(length)
        ours = [n for n in self.chain.PARAMS if bool((rank[positions[spans[n]]] >= 0).any())]
        if not ours:
            raise ValueError(f"wrt: the loss does not depend on {names} (with this input), "
                             f"so every derivative in it is zero")
        kept = [spans[n] for n in ours]
        return ours, kept, torch.cat([rank[positions[span]] for span in kept]), count

    def _prepared(self, X: torch.Tensor, T: torch.Tensor | None = None) -> tuple:
        X = self.recognised.inputs(X)
        return (X, None if T is None else self.recognised.targets(T), X.shape[-2])

    # -- the contract ---------------------------------------------------------------------
    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """The model's output (``(B, L, d)``; logits ``(B, c)`` for a classifier)."""
        X, _, length = self._prepared(X)
        return self.recognised.outputs(self.chain.forward(self.params(length), X))

    @over_batches(state=lambda self: self.model)
    def loss(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the batch (a scalar)."""
        X, T, length = self._prepared(X, T)
        return self.chain.loss(self.params(length), X, T)

    def _check_input_wrt(self) -> None:
        if not self.recognised.takes_rows:
            raise ValueError("wrt: 'X' is offered for models taking rows (B, L, d); this "
                             "model takes its input in another layout (images, cut into "
                             "patches first), so ask for its parameters")

    @over_batches(state=lambda self: self.model)
    def gradient(self, X: torch.Tensor, T: torch.Tensor,
                 wrt: str | list[str] | None = None) -> torch.Tensor:
        """The loss's gradient over ``wrt`` (default: every parameter), ``(n,)`` in the
        model's order; ``wrt="X"``: per sample ``(B, L·d)``."""
        X, T, length = self._prepared(X, T)
        if isinstance(wrt, str) and wrt == "X":
            self._check_input_wrt()
            return self.chain.gradient(self.params(length), X, T, wrt="X")
        _, spans, where, n = self._selection(wrt, length)
        full = self.chain.gradient(self.params(length), X, T)
        return self._placed(torch.cat([full[span] for span in spans]), where, n)

    def jacobian(self, X: torch.Tensor, wrt: str) -> torch.Tensor:
        """``∂vec(output)/∂vec(wrt)`` per sample, ``(B, n_out, n_wrt)``, columns in the
        layout of the model's parameter ``wrt`` (or of ``X``)."""
        X, _, length = self._prepared(X)
        if wrt == "X":
            self._check_input_wrt()
            return self.chain.jacobian(self.params(length), X, "X")
        if not isinstance(wrt, str):
            raise ValueError(f"wrt: expected one name of the model's parameters, got {wrt!r}")
        ours, _, where, n = self._selection(wrt, length)
        params = self.params(length)
        J = torch.cat([self.chain.jacobian(params, X, name) for name in ours], dim=-1)
        return self._placed(J, where, n)

    @over_batches(state=lambda self: self.model)
    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor, wrt: str | list[str] | None = None,
                     part: str = "full") -> torch.Tensor:
        """The loss Hessian over ``wrt`` (default: every parameter), ``(n, n)`` in the
        model's order, cross-layer blocks included; ``part`` ``"full"``,
        ``"gauss_newton"`` or ``"functional"``; ``wrt="X"``: per sample
        ``(B, L·d, L·d)``."""
        X, T, length = self._prepared(X, T)
        if isinstance(wrt, str) and wrt == "X":
            self._check_input_wrt()
            return self.chain.loss_hessian(self.params(length), X, T, wrt="X", part=part)
        ours, _, where, n = self._selection(wrt, length)
        H = self.chain.loss_hessian(self.params(length), X, T, wrt=ours, part=part)
        out = H.new_zeros(n, n)
        keep = where >= 0
        rows = where[keep]
        out[rows[:, None], rows[None, :]] = H[keep][:, keep]
        return out

    def loss_hessian_mixed(self, X: torch.Tensor, T: torch.Tensor,
                           wrt: str | list[str] | None = None,
                           part: str = "full") -> torch.Tensor:
        """Per sample, the loss Hessian between ``X`` and ``wrt`` (default: every
        parameter), ``(B, L·d, n)``, columns in the model's order."""
        self._check_input_wrt()
        X, T, length = self._prepared(X, T)
        ours, _, where, n = self._selection(wrt, length)
        H = self.chain.loss_hessian_mixed(self.params(length), X, T, wrt=ours, part=part)
        return self._placed(H, where, n)

    @over_batches(state=lambda self: self.model)
    def hvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
            wrt: str | list[str] | None = None) -> torch.Tensor:
        """The loss Hessian over ``wrt`` times ``v`` (both in the model's order), ``(n,)``, or
        times each column of ``v`` ``(n, k)``, without forming the Hessian; ``wrt="X"``: per
        sample ``(B, L·d)``."""
        return self._product(self.chain.hvp, X, T, v, wrt)

    @over_batches(state=lambda self: self.model)
    def gnvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
             wrt: str | list[str] | None = None) -> torch.Tensor:
        """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` (``J`` the whole model's Jacobian) of
        the loss Hessian over ``wrt`` times ``v``, shapes as for :meth:`hvp`."""
        return self._product(self.chain.gnvp, X, T, v, wrt)

    def _product(self, product, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
                 wrt: str | list[str] | None) -> torch.Tensor:
        X, T, length = self._prepared(X, T)
        if isinstance(wrt, str) and wrt == "X":
            self._check_input_wrt()
            if tuple(v.shape) != tuple(X.reshape(X.shape[0], -1).shape):
                raise ValueError(f"v: expected shape {tuple(X.reshape(X.shape[0], -1).shape)} "
                                 f"(each input's entries), got shape {tuple(v.shape)}")
            return product(self.params(length), X, T, v, wrt="X")
        ours, _, where, n = self._selection(wrt, length)
        if v.ndim not in (1, 2) or v.shape[0] != n:
            raise ValueError(f"v: expected shape ({n},) or ({n}, k) (the entries of "
                             f"{wrt or 'every parameter'}), got shape {tuple(v.shape)}")
        keep = where >= 0
        v_ours = v.new_zeros(where.numel(), *v.shape[1:])
        v_ours[keep] = v[where[keep]]
        out = product(self.params(length), X, T, v_ours, wrt=ours)
        return self._placed(out.movedim(0, -1), where, n).movedim(-1, 0)

    @over_batches(state=lambda self: self.model)
    def diagonal(self, X: torch.Tensor, T: torch.Tensor, wrt: str | list[str] | None = None,
                 part: str = "full") -> torch.Tensor:
        """The diagonal of :meth:`loss_hessian` without forming a block over parameters,
        ``(n,)`` in the model's order; ``wrt="X"``: per sample ``(B, L·d)``."""
        X, T, length = self._prepared(X, T)
        if isinstance(wrt, str) and wrt == "X":
            self._check_input_wrt()
            return self.chain.diagonal(self.params(length), X, T, wrt="X", part=part)
        ours, _, where, n = self._selection(wrt, length)
        return self._placed(self.chain.diagonal(self.params(length), X, T, wrt=ours,
                                                part=part), where, n)

    @takes_batches
    def hessian_operator(self, X: torch.Tensor, T: torch.Tensor,
                         wrt: str | list[str] | None = None,
                         part: str = "full") -> CurvatureOperator:
        """The loss Hessian over ``wrt`` (its ``part``) as a linear operator in the model's
        order (:class:`~curvgap.operators.CurvatureOperator`). On one batch the weights are
        read now; over a dataset's batches every product is a pass over them (as for a
        single layer)."""
        if is_batches(X):
            data, like = (X,), next(self.model.parameters())
            n = sum(self._index[name].numel() for name in self._names(wrt))
        else:
            data, like = (X, T), X
            n = self._selection(wrt, self._prepared(X)[2])[3]
            self.loss(X, T)  # checks X and T now, not at the first product
        return CurvatureOperator(part_product(
            lambda V: self.hvp(*data, V, wrt), lambda V: self.gnvp(*data, V, wrt), part),
            n, like.dtype, like.device)

    def layer_slices(self, wrt: str | list[str] | None = None) -> dict[str, slice]:
        """Where each of the model's parameters (``wrt``, default all) lies in the rows of
        ``loss_hessian`` and ``gradient``: name → slice."""
        names = self.names if wrt is None else [wrt] if isinstance(wrt, str) else list(wrt)
        slices, offset = {}, 0
        for name, parameter in self.model.named_parameters():
            if name in names:
                slices[name] = slice(offset, offset + parameter.numel())
                offset += parameter.numel()
        return slices

    @staticmethod
    def _placed(values: torch.Tensor, where: torch.Tensor, n: int) -> torch.Tensor:
        """``values`` (last axis over the chain's entries) with their last axis moved to
        the ``n`` entries of ``wrt`` by ``where`` (zeros where nothing lands)."""
        out = values.new_zeros(*values.shape[:-1], n)
        keep = where >= 0
        out[..., where[keep]] = values[..., keep]
        return out
