"""The exact loss Hessian of a chain of parts, backpropagated one block at a time.

Per sample ``b``, with ``g_k = ∂ℓ_b/∂Z_k`` and ``M_k = ∂²ℓ_b/∂Z_k²``, block ``k`` (input
``Z_{k-1}``) gives its Jacobians ``J_X, J_θ`` and, from the module of its config with the
``linear`` loss ``Σ g_k∘Z_k``, the second derivatives contracted with ``g_k``:
``A = Σ g ∂²Z/∂X²``, ``C = Σ g ∂²Z/∂X∂θ``, ``D = Σ g ∂²Z/∂θ²``. Then

    H(X, X) = J_X^T M_k J_X + A            = M_{k-1}
    H(X, θ_k) = J_X^T M_k J_θ + C
    H(θ_k, θ_k) = mean_b J_θ^T M_k J_θ + D
    H(θ_a, θ_k) = mean_b (∂Z_{k-1}/∂θ_a)^T H(X, θ_k),   a < k,

with ``∂Z_{k-1}/∂θ_a = J_X^{(k-1)} ⋯ J_X^{(a+1)} J_θ^{(a)}``, carried down as
``J_X^T H(X, θ_k)`` one block at a time; the top block's three blocks come straight from the
module with the config's own loss. Each block row of the Hessian costs one pass down the
layers below it. Where ``M_k`` has low rank (behind a cross-entropy head over ``c`` classes,
at most ``c − 1`` per sample) it is used as its eigenfactors, ``M = U diag(λ) U^T``, so the
products cost ``r/n`` of the dense ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from .arrays import Array, NumpyArrays, TorchArrays


@dataclass
class Point:
    """Where a chain's Hessian (or its diagonal) is taken: per part its parameters and
    constants (``layers``), its input (``inputs``, batch first) and the cotangent of its
    output per sample (``g``; None for the top part), the loss's ``target``, per part the
    names of its parameters asked (``chosen``) and the lowest part with one (``lowest``),
    whether the input's block is asked (``to_input``), the ``part`` of the Hessian
    (``"full"`` or ``"gauss_newton"``), and for a parameter read in several places (``(part,
    name)``, of one shape, a transposed place read in its source's layout), each place → the
    others (``shared``) and → its group's first place with the index that reads its entries
    in that place's layout, or None (``homes``)."""

    layers: list[dict]
    inputs: list[Array]
    g: list
    target: Array
    chosen: list[list[str]]
    lowest: int
    to_input: bool
    part: str
    shared: dict[tuple[int, str], list[tuple[int, str]]] = field(default_factory=dict)
    homes: dict[tuple[int, str], tuple] = field(default_factory=dict)
    #: per part, the entries of one sample's input
    sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.sizes = [int(np.prod(x.shape[1:])) for x in self.inputs]

    @property
    def bottom(self) -> int:
        """The lowest part the sweeps visit."""
        return 0 if self.to_input else self.lowest

    def against(self, k: int) -> Array:
        """What part ``k``'s second derivatives are taken against: the loss's target for the
        top part, else the cotangent of its output."""
        return self.target if k == len(self.inputs) - 1 else self.g[k]


def backpropagate(modules: list[ModuleType], arrays: NumpyArrays | TorchArrays, at: Point,
                  low_rank: Callable[[Array], tuple[Array, Array] | None]) -> tuple:
    """Hessian backpropagation through the parts' ``modules`` over the parameters asked at
    ``at``, from the top part down to the lowest one with one of them (or to the input):
    ``(H (n, n), ∂²ℓ_b/∂X² (B, n_X, n_X) or None, ∂²ℓ_b/∂X∂θ (B, n_X, n) or None)``, the
    blocks of ``H`` in part order. ``low_rank(M)`` gives ``M``'s eigenfactors ``(U, λ)``
    where it has low rank, else None."""
    depth = len(modules)
    # the input's Jacobian of every part below the top, but the lowest's only for blocks in X
    # (token ids as the input are data: no derivative in them)
    J_X = {k: modules[k].jacobian(at.layers[k], at.inputs[k], "X")
           for k in range(at.lowest if at.to_input else at.lowest + 1, depth - 1)}
    J_t = {k: arrays.cat([modules[k].jacobian(at.layers[k], at.inputs[k], name)
                          for name in names], -1)
           for k, names in enumerate(at.chosen) if names}
    sizes = [J_t[k].shape[-1] if k in J_t else 0 for k in range(depth)]
    offsets = [sum(sizes[:k]) for k in range(depth + 1)]
    H = arrays.zeros((offsets[-1], offsets[-1]), at.inputs[0])
    mixed = [] if at.to_input else None  # the (X, θ_k) blocks, part by part
    batch, M = at.inputs[0].shape[0], None  # M: ∂²ℓ_b/∂Z², per sample, at the output of part k
    for k in range(depth - 1, at.lowest - 1, -1):
        module, names = modules[k], at.chosen[k]
        args = (at.layers[k], at.inputs[k], at.against(k))
        H_XX, below = None, k > at.lowest or at.to_input  # below: X's blocks are carried
        # M = U diag(λ) U^T per sample, when it has low rank (behind a cross-entropy
        # head, rank ≤ classes - 1): the products with M then go through U^T J
        factor = None if M is None else low_rank(M)
        if factor is not None:
            U, scale = factor
            G_X = U.swapaxes(1, 2) @ J_X[k] if k in J_X else None
        if below:
            H_XX = module.loss_hessian(*args, wrt="X", part=at.part)
            if factor is not None:  # the curvature from above, carried
                H_XX = H_XX + G_X.swapaxes(1, 2) @ (scale[..., None] * G_X)
            elif M is not None:
                H_XX = H_XX + J_X[k].swapaxes(1, 2) @ (M @ J_X[k])
        if names:
            H_Xt = module.loss_hessian_mixed(*args, wrt=names, part=at.part) if below else None
            H_tt = module.loss_hessian(*args, wrt=names, part=at.part)
            if factor is not None:
                G_t = U.swapaxes(1, 2) @ J_t[k]
                scaled = scale[..., None] * G_t
                H_Xt = H_Xt + G_X.swapaxes(1, 2) @ scaled if below else None
                H_tt = H_tt + (G_t.reshape(-1, sizes[k]).T  # mean over samples
                               @ scaled.reshape(-1, sizes[k])) / batch
            elif M is not None:
                MJ_t = M @ J_t[k]
                H_Xt = H_Xt + J_X[k].swapaxes(1, 2) @ MJ_t if below else None
                H_tt = H_tt + (J_t[k].reshape(-1, sizes[k]).T  # mean over samples
                               @ MJ_t.reshape(-1, sizes[k])) / batch
            rows = slice(offsets[k], offsets[k + 1])
            H[rows, rows] = H_tt
            carried = H_Xt  # ∂²ℓ_b/∂Z_a∂θ_k for the output Z_a of each part a below
            for a in range(k - 1, at.lowest - 1, -1):
                if a in J_t:  # mean over samples (and a sum over the output's entries)
                    block = (J_t[a].reshape(-1, sizes[a]).T
                             @ carried.reshape(-1, sizes[k])) / batch
                    H[offsets[a]:offsets[a + 1], rows] = block
                    H[rows, offsets[a]:offsets[a + 1]] = block.T
                if a > at.lowest or at.to_input:
                    carried = J_X[a].swapaxes(1, 2) @ carried
            if at.to_input:
                mixed.insert(0, carried)
        M = H_XX
    if not at.to_input:
        return H, None, None
    return H, M, arrays.cat(mixed, -1) if mixed else None
