"""``curvgap.curvature(layer)``: the contract's functions for a real layer, in the layer's own
parameter order and layout.

The module of the layer's config is generated on first use into the cache
(:mod:`curvgap.codegen.cache`) and reused while it is current. Weights are read from the
layer at every call. Rows and columns of Hessians, entries of HVPs and columns of Jacobians
follow
``torch.cat([p.reshape(-1) for p in layer.parameters()])``; ``wrt`` takes the layer's own
parameter names (or ``"X"``).

In place of ``X, T``, the averaging functions (``loss``, ``gradient``, ``loss_hessian``,
``hvp``, ``gnvp``, ``diagonal``) and ``hessian_operator`` take a dataset's batches (a
``DataLoader`` of ``(X, T)``) and give the mean over its samples, over every rank's shard
under ``torch.distributed`` (:mod:`curvgap.data`).
"""

from __future__ import annotations

import torch

from ..codegen.cache import module_for
from ..data import is_batches, over_batches, takes_batches
from ..operators.hessian import CurvatureOperator, part_product
from ..operators.kronecker import KroneckerSum, kronecker_block
from .layers import flat_index
from .recognise import recognise


class Curvature:
    """Exact derivatives of ``layer``'s loss (the config's: ``"mse"`` is
    ``F.mse_loss(layer(X), T)``). ``X`` is ``(B, L, d)`` (or one sample ``(L, d)``)."""

    def __init__(self, layer: torch.nn.Module, loss: str = "mse") -> None:
        self.layer = layer
        self.recognised = recognise(layer, loss)
        self.module = module_for(self.recognised.config)
        self.names = list(self.recognised.names)
        # where each entry of the module's parameters lives in the layer's flat vector
        index = flat_index(layer)
        mapped = self.recognised.ours(index)
        self._index, self._entries = index, mapped
        self._selections: dict[tuple[str, ...], tuple[list[str], torch.Tensor]] = {}
        self._ours = [name for name, _ in self.module.PARAMS]
        self._position = {name: mapped[name].reshape(-1) for name in self._ours}
        self._owner = {name: next(n for n, entries in index.items()
                                  if int(mapped[name].reshape(-1)[0]) in entries)
                       for name in self._ours}

    # -- the layer's parameters as the module's -------------------------------------------
    def params(self) -> dict[str, torch.Tensor]:
        """The module's parameters, read from the layer now."""
        values = {n: p.detach() for n, p in self.layer.named_parameters()}
        return {n: v.contiguous() for n, v in self.recognised.ours(values).items()}

    def _ours_of(self, wrt: str | list[str] | None) -> tuple[list[str], torch.Tensor]:
        """The module's parameters that make up the layer's ``wrt``, and the permutation
        from their concatenation to the layer's order of ``wrt``."""
        return self._selection(wrt)[:2]

    def _selection(self, wrt: str | list[str] | None
                   ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """:meth:`_ours_of`'s pair and the inverse permutation, sorted once per ``wrt``."""
        names = self.names if wrt is None else [wrt] if isinstance(wrt, str) else list(wrt)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"wrt: expected 'X' or names of the layer's parameters "
                             f"{self.names}, got {unknown}")
        key = tuple(names)
        if key not in self._selections:  # sorting millions of positions: once per wrt
            self._selections[key] = self._permutation(names)
        return self._selections[key]

    def _permutation(self, names: list[str]) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """:meth:`_ours_of`'s pair, and the inverse permutation (the layer's order of ``wrt``
        to the module's concatenation)."""
        ours = [n for n in self._ours if self._owner[n] in names]
        positions = torch.cat([self._position[n] for n in ours])
        # renumber the layer's positions of the requested parameters 0..n-1, in layer order
        back = torch.argsort(positions)
        inverse = torch.empty_like(back)
        inverse[back] = torch.arange(len(back))
        return ours, back, inverse

    # -- the contract -----------------------------------------------------------------------
    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """The layer's output ``(B, L, d)``."""
        return self.module.forward(self.params(), X)

    @over_batches(state=lambda self: self.layer)
    def loss(self, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the batch (a scalar)."""
        return self.module.loss(self.params(), X, T)

    @over_batches(state=lambda self: self.layer)
    def gradient(self, X: torch.Tensor, T: torch.Tensor,
                 wrt: str | list[str] | None = None) -> torch.Tensor:
        """The loss's gradient over ``wrt`` (default: every parameter) in the layer's order,
        ``(n,)``; ``wrt="X"``: per sample ``(B, L·d)``."""
        if wrt == "X":
            return self.module.gradient(self.params(), X, T, wrt="X")
        ours, back = self._ours_of(wrt)
        return self.module.gradient(self.params(), X, T, wrt=ours)[back]

    def jacobian(self, X: torch.Tensor, wrt: str) -> torch.Tensor:
        """``∂vec(output)/∂vec(wrt)`` per sample, ``(B, L·d, n_wrt)``, columns in the layout of
        the layer's parameter ``wrt`` (or of ``X``)."""
        if wrt == "X":
            return self.module.jacobian(self.params(), X, "X")
        ours, back = self._ours_of(wrt)
        params = self.params()
        J = torch.cat([self.module.jacobian(params, X, n) for n in ours], dim=-1)
        return J[..., back]

    @over_batches(state=lambda self: self.layer)
    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor, wrt: str | list[str] | None = None,
                     part: str = "full") -> torch.Tensor:
        """The loss Hessian over ``wrt`` (default: every parameter), ``(n, n)`` in the layer's
        order; ``part`` ``"full"``, ``"gauss_newton"`` or ``"functional"``. ``wrt="X"``:
        per sample ``(B, L·d, L·d)``."""
        if wrt == "X":
            return self.module.loss_hessian(self.params(), X, T, wrt="X", part=part)
        ours, back = self._ours_of(wrt)
        H = self.module.loss_hessian(self.params(), X, T, wrt=ours, part=part)
        return H[back][:, back]

    def loss_hessian_mixed(self, X: torch.Tensor, T: torch.Tensor,
                           wrt: str | list[str] | None = None,
                           part: str = "full") -> torch.Tensor:
        """Per sample, the loss Hessian between ``X`` and ``wrt`` (default: every
        parameter), ``(B, L·d, n)``, columns in the layer's order."""
        ours, back = self._ours_of(wrt)
        H = self.module.loss_hessian_mixed(self.params(), X, T, wrt=ours, part=part)
        return H[..., back]

    @over_batches(state=lambda self: self.layer)
    def hvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
            wrt: str | list[str] | None = None) -> torch.Tensor:
        """The loss Hessian over ``wrt`` times ``v`` (both in the layer's order), ``(n,)``, or
        times each column of ``v`` ``(n, k)``, ``(n, k)``."""
        return self._product(self.module.hvp, X, T, v, wrt)

    @over_batches(state=lambda self: self.layer)
    def gnvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
             wrt: str | list[str] | None = None) -> torch.Tensor:
        """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` of the loss Hessian over ``wrt`` times
        ``v``, shapes as for :meth:`hvp`."""
        return self._product(self.module.gnvp, X, T, v, wrt)

    def _product(self, product, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
                 wrt: str | list[str] | None) -> torch.Tensor:
        ours, back, inverse = self._selection(wrt)
        if v.ndim not in (1, 2) or v.shape[0] != back.shape[0]:
            raise ValueError(f"v: expected shape ({back.shape[0]},) or ({back.shape[0]}, k) "
                             f"(the entries of {wrt or 'every parameter'}), got shape "
                             f"{tuple(v.shape)}")
        v_ours = v.index_select(0, inverse)  # gathers: faster than scattering millions
        return product(self.params(), X, T, v_ours, wrt=ours).index_select(0, back)

    @over_batches(state=lambda self: self.layer)
    def diagonal(self, X: torch.Tensor, T: torch.Tensor, wrt: str | list[str] | None = None,
                 part: str = "full") -> torch.Tensor:
        """The diagonal of :meth:`loss_hessian` without forming it, ``(n,)`` in the layer's
        order; ``wrt="X"``: per sample ``(B, L·d)``."""
        if wrt == "X":
            return self.module.diagonal(self.params(), X, T, wrt="X", part=part)
        ours, back = self._ours_of(wrt)
        return self.module.diagonal(self.params(), X, T, wrt=ours, part=part)[back]

    def kronecker_block(self, X: torch.Tensor, T: torch.Tensor, wrt_i: str,
                        wrt_j: str | None = None, part: str = "full") -> KroneckerSum:
        """The loss-Hessian block ``(wrt_i, wrt_j)`` (layer parameter names; ``wrt_j``
        default ``wrt_i``) as its Kronecker factors in the layer's layout
        (:class:`~curvgap.operators.KroneckerSum`), where the block is exactly such a sum for
        this architecture and each name is one whole matrix of the module (held as it is or
        transposed: ``A ⊗ B`` of the module's layout is ``B ⊗ A`` in the transposed one)."""
        first, flip_i = self._whole(wrt_i, "wrt_i")
        second, flip_j = self._whole(wrt_i if wrt_j is None else wrt_j, "wrt_j")
        if (first, second, part) not in self.module.STRUCTURED:
            blocks = [f"({self._owner[v]}, {self._owner[w]}, {p!r})"
                      for v, w, p in self.module.STRUCTURED]
            raise ValueError(f"wrt_i, wrt_j: expected a block that is exactly a sum of "
                             f"Kronecker products in this layer ({', '.join(blocks) or 'none'}"
                             f"), got ({wrt_i}, {wrt_j or wrt_i}, {part!r})")
        block = kronecker_block(self.module, self.params(), X, T, first, second, part)
        if flip_i != flip_j:
            raise ValueError(f"wrt_i, wrt_j: expected parameters held alike (both as the "
                             f"module's {first}, {second} or both transposed), got "
                             f"{wrt_i!r}, {wrt_j!r}")
        if not flip_i:
            return block
        swapped = [(B, A) for A, B in block.products]
        return KroneckerSum(swapped, block.right_shape, block.left_shape)

    def _whole(self, name: str, argument: str) -> tuple[str, bool]:
        """The module's parameter that is exactly the layer's parameter ``name``, and whether
        the layer holds it transposed."""
        if name not in self._index:
            raise ValueError(f"{argument}: expected a name of the layer's parameters "
                             f"{self.names}, got {name!r}")
        entries = self._index[name]
        for ours in self._ours:
            held = self._entries[ours]
            if held.shape == entries.shape and torch.equal(held, entries):
                return ours, False
            if held.ndim == 2 and held.T.shape == entries.shape and torch.equal(held.T, entries):
                return ours, True
        raise ValueError(f"{argument}: expected a parameter that is one whole matrix of the "
                         f"module ({name!r} holds parts of several, or part of one)")

    @takes_batches
    def hessian_operator(self, X: torch.Tensor, T: torch.Tensor,
                         wrt: str | list[str] | None = None,
                         part: str = "full") -> CurvatureOperator:
        """The loss Hessian over ``wrt`` (its ``part``) as a linear operator in the layer's
        order (:class:`~curvgap.operators.CurvatureOperator`), for scipy's and curvlinops'
        solvers and estimators. On one batch the weights are read now; over a dataset's
        batches every product is a pass over them (collective under ``torch.distributed``:
        every rank runs the same solver with the same start, see :mod:`curvgap.data`)."""
        n = self._ours_of(wrt)[1].shape[0]
        if is_batches(X):
            data, like = (X,), next(iter(self.params().values()))
        else:
            data, like = (X, T), X
            self.loss(X, T)  # checks X and T now, not at the first product
        return CurvatureOperator(part_product(
            lambda V: self.hvp(*data, V, wrt), lambda V: self.gnvp(*data, V, wrt), part),
            n, like.dtype, like.device)
