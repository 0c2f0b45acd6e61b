"""Hessian- and Gauss–Newton-vector products of a chain of parts, matrix-free
(Pearlmutter's forward-over-reverse, one part at a time), never forming a Hessian block.

After one forward pass, tangents ``dZ_k = J_X dZ_{k-1} + J_θ v_k`` go up through each part's
``jvp``; the cotangents' tangents ``dg_{k-1}`` and the products ``(Hv)_k`` come down through
each part's ``hvp_joint`` along ``(v_k, dZ_{k-1})`` with its cotangent ``g_k`` as the linear
loss's target and ``dg_k`` as that target's direction (which adds ``J^T dg_k``):

    (dg_{k-1}, (Hv)_k) = (∂²(g_k·Z_k)/∂(X, θ_k)²) (dZ_{k-1}, v_k) + J^T dg_k.

The Gauss–Newton product ``mean_b J_b^T (∂²ℓ_b/∂Z_N²) J_b v`` takes the top part's loss
curvature and then only transposed Jacobians down (``vjp``): no part's second derivative.
"""

from __future__ import annotations

import numpy as np

from ..data import over_batches
from .arrays import Array, written


class ProductSweeps:
    """The products of :class:`~curvgap.models.chain.Chain` (which it is mixed into: it
    reads the chain's ``modules``, ``ties``, ``arrays`` and its forward and adjoint sweeps)."""

    def product_pieces(self, kind: str, params: dict[str, Array], X: Array, target: Array,
                       directions: list[dict[str, Array]] | Array,
                       keep: dict | None = None, out: list[dict] | None = None) -> list:
        """``kind`` (``"hvp"`` or ``"gnvp"``) along each direction of ``directions``: a list of
        dicts (name of ``PARAMS`` → direction shaped as the parameter; those left out are
        zero), each giving a dict of the products over the parameters it names; or a per-sample
        direction in the input, shaped as ``X``, giving per sample the product in the input.
        One forward pass is kept for all directions (from the lowest part a direction moves),
        then per direction one tangent sweep up (each part's ``jvp_saved``) and one sweep down
        (``hvp_saved``: the adjoints, shared by the directions, and their tangents; ``gnvp``:
        the top part's ``gnvp_saved``, then each part's transposed Jacobians by
        ``vjp_saved``, no second derivative, so that the parts below the top drop their
        inner tangents on the way up). ``keep``, a dict its caller holds between calls
        at one point (the same ``params``, ``X`` and ``target``, as an operator does), keeps
        that forward pass and the adjoints the sweeps compute, so later calls run only the
        tangent and second-order sweeps. Results are in the dtype they are computed in, not
        yet checked for overflow; ``out`` (per direction, as for :meth:`gradient_pieces`)
        holds the arrays they are written into."""
        if kind not in ("hvp", "gnvp"):
            raise ValueError(f"kind: expected 'hvp' or 'gnvp', got {kind!r}")
        per_sample = not isinstance(directions, list)
        outs = ([None] * len(directions) if per_sample or out is None
                else [self._computed_out(o, X) for o in out])
        params, X, (target,) = self._widened(params, X, target)
        wide = self.arrays.wide  # the directions computed in X's dtype too
        directions = (wide(directions) if per_sample else
                      [{k: wide(a) for k, a in d.items()} for d in directions])
        if per_sample:
            columns, lowest = [directions], 0
        else:  # a tied parameter moves along its source's direction, as it reads it
            directions = [self.ties.untie(d) for d in directions]
            columns = [[{name: d[key] for name, key in keys.items() if key in d}
                        for keys in self.part_keys] for d in directions]
            moving = [k for k in range(self.depth) if any(c[k] for c in columns)]
            if not moving:
                return [{} for _ in columns]
            lowest = moving[0]
        if keep is not None and keep.get("lowest") == lowest:
            saved = keep["saved"]
        else:
            saved = self._saved(self._layers(params), X, lowest)
            if keep is not None:
                keep.update(lowest=lowest, saved=saved)
        results = []
        for j, column in enumerate(columns):
            last = j == len(columns) - 1 and keep is None  # its forward values then freed
            tangent = column if per_sample else None
            top = self.depth - 1
            for k in range(lowest, self.depth):
                # the sweep down reads a part's inner tangents for an HVP, and for a
                # Gauss–Newton product only at the top (below it: transposed Jacobians)
                tangent = self.modules[k].jvp_saved(saved[k], None if per_sample else column[k],
                                                    tangent, keep_inner=kind == "hvp" or k == top)
            products: list = [None] * self.depth
            if kind == "hvp":
                down, cotangent = None, target
                for k in range(top, lowest - 1, -1):
                    products[k], down, cotangent = self.modules[k].hvp_saved(
                        saved[k], cotangent, down, out=self._part_out(k, outs[j]))
                    saved[k] = None if last else saved[k]
            else:
                products[top], down = self.modules[top].gnvp_saved(
                    saved[top], target, out=self._part_out(top, outs[j]))
                for k in range(top - 1, lowest - 1, -1):
                    products[k], down = self.modules[k].vjp_saved(
                        saved[k], down, out=self._part_out(k, outs[j]))
                    saved[k] = None if last else saved[k]
            results.append(down if per_sample else self.ties.folded(
                {self.part_keys[k][name]: products[k][name]
                 for k in range(lowest, self.depth) for name in column[k]}, outs[j]))
        return results

    def _product(self, kind: str, params: dict[str, Array], X: Array, target: Array,
                 v: Array, wrt: str | list[str] | None) -> Array:
        """:meth:`product_pieces` for ``v`` over ``wrt``, concatenated and checked."""
        single = len(X.shape) == len(self.modules[0].INPUT_SHAPE)
        if single:
            X, target = X[None], target[None]
        name = "Hessian" if kind == "hvp" else "Gauss–Newton"
        quantity = f"{kind}: the {name}-vector product"
        if isinstance(wrt, str) and wrt == "X":  # per sample, a direction in each input
            n = int(np.prod(X.shape[1:]))
            expected = (n,) if single else (X.shape[0], n)
            if tuple(v.shape) != expected:
                raise ValueError(f"v: expected shape {expected} (the input's vec_r per "
                                 f"sample), got shape {tuple(v.shape)}")
            down = self.product_pieces(kind, params, X, target, v.reshape(X.shape))[0]
            value = down.reshape(X.shape[0], -1)
            return self._finished(value[0] if single else value, X, quantity)
        chosen = self._keys(self._chosen(wrt, tied=False))  # checked, in PARAMS order
        shapes = [tuple(params[name].shape) for name in chosen]
        sizes = [int(np.prod(shape)) for shape in shapes]
        if getattr(v, "ndim", 1) not in (1, 2) or tuple(v.shape[:1]) != (sum(sizes),):
            raise ValueError(f"v: expected shape ({sum(sizes)},) or ({sum(sizes)}, k) (the "
                             f"vec_r of the wrt parameters concatenated), got shape "
                             f"{tuple(v.shape)}")
        matrix = v.ndim == 2
        directions = []
        for column in ([v[:, j] for j in range(v.shape[1])] if matrix else [v]):
            offsets = np.cumsum([0, *sizes])
            directions.append({name: column[offsets[i]:offsets[i + 1]].reshape(shape)
                               for i, (name, shape) in enumerate(zip(chosen, shapes))})
        if matrix:
            results = [self.arrays.cat([pieces[name].reshape(-1) for name in chosen])
                       for pieces in self.product_pieces(kind, params, X, target, directions)]
            value = self.arrays.stack(results, 1)
            return self._finished(value, X, quantity)
        value, out = self._flat_out(params, chosen, X)
        (pieces,) = self.product_pieces(kind, params, X, target, directions, out=[out])
        for name in chosen:
            written(out[name], pieces[name])
        return self._finished(value, X, quantity)

    @over_batches()
    def hvp(self, params: dict[str, Array], X: Array, target: Array, v: Array,
            wrt: str | list[str] | None = None) -> Array:
        """The loss Hessian over ``wrt`` (default: all of ``PARAMS``) times ``v`` (the
        ``wrt`` blocks of ``vec_r`` concatenated, in ``PARAMS`` order), shape ``(n,)``, or
        with ``wrt="X"`` per sample ``(B, n_X)`` for ``v`` of shape ``(B, n_X)``, without
        forming the Hessian (Pearlmutter's forward-over-reverse, one part at a time): one
        forward pass, then the tangents ``dZ_k`` up through each part from the lowest in
        ``wrt``, and down the cotangents ``g_k``, their tangents ``dg_k`` and the products.
        A matrix ``v`` of shape ``(n, k)`` gives the ``k`` products as columns, ``(n, k)``,
        sharing the forward pass and the adjoints."""
        return self._product("hvp", params, X, target, v, wrt)

    @over_batches()
    def gnvp(self, params: dict[str, Array], X: Array, target: Array, v: Array,
             wrt: str | list[str] | None = None) -> Array:
        """The Gauss–Newton part of the loss Hessian over ``wrt`` times ``v`` (shapes as for
        :meth:`hvp`), ``mean_b J_b^T (∂²ℓ_b/∂Z_N²) J_b v`` with ``J`` the whole model's
        Jacobian: ``J v`` up through each part, the top part's loss curvature, then the
        transposed Jacobians down (no second derivative of any part enters)."""
        return self._product("gnvp", params, X, target, v, wrt)

