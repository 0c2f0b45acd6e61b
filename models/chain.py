"""Chains of generated modules, ``Z_k = part_k(Z_{k-1}; θ_k)``, ``Z_0 = X``, with the last
part's loss on the output (a :class:`Stack` is ``N`` blocks of one config): the gradient
and the exact loss Hessian over the parameters of every part, composed from the parts'
generated functions by the chain rule (Hessian backpropagation), so that one derivation of
a block serves every depth.

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
module with the config's own loss. The gradient costs one pass per block, each block row
of the Hessian one pass down the layers below it.
"""

from __future__ import annotations

import dataclasses

import torch

from ..codegen.cache import module_for
from ..derivations.config import Config


class Chain:
    """Parts applied one after another, ``Z_k = part_k(Z_{k-1}; θ_k)``, ``Z_0 = X``, each part
    a ``(prefix, config)`` of a kind that keeps the shape ``(L, d)`` (a block, a norm, an
    FFN, self-attention), the last part's loss on the output. Parameters are named
    ``"<prefix>.<name>"`` in part order, each part's in its module's ``PARAMS`` order.
    Inputs are torch tensors, ``X`` of shape ``(B, L, d)``."""

    def __init__(self, parts: list[tuple[str, Config]]) -> None:
        if not parts:
            raise ValueError("parts: expected at least one (prefix, config), got none")
        self.prefixes = [prefix for prefix, _ in parts]
        # every part but the last with the linear loss: its second derivatives against the
        # cotangent from above; the last with the model's loss
        self.modules = [module_for(dataclasses.replace(config, loss="linear"))
                        for _, config in parts[:-1]] + [module_for(parts[-1][1])]
        self.part_params = [[name for name, _ in module.PARAMS] for module in self.modules]
        empty = [prefix for prefix, names in zip(self.prefixes, self.part_params) if not names]
        if empty:
            raise ValueError(f"parts: expected parts with parameters, got none in {empty}")
        self.PARAMS = [f"{prefix}.{name}" for prefix, names in zip(self.prefixes,
                                                                    self.part_params)
                       for name in names]
        self.depth = len(parts)


    def _layers(self, params: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        missing = [name for name in self.PARAMS if name not in params]
        unknown = sorted(set(params) - set(self.PARAMS))
        if missing or unknown:
            raise ValueError(f"params: expected exactly the keys {self.PARAMS}, got unknown "
                             f"{unknown} and missing {missing}")
        return [{name: params[f"{prefix}.{name}"] for name in names}
                for prefix, names in zip(self.prefixes, self.part_params)]

    def _inputs(self, layers: list[dict], X: torch.Tensor) -> list[torch.Tensor]:
        """``Z_0 = X, Z_1, …, Z_{N-1}``: the input of each block."""
        inputs = [X]
        for module, params in zip(self.modules[:-1], layers[:-1]):
            inputs.append(module.forward(params, inputs[-1]))
        return inputs

    def forward(self, params: dict[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        """``Z_N``, shape ``(B, L, d)``."""
        layers = self._layers(params)
        return self.modules[-1].forward(layers[-1], self._inputs(layers, X)[-1])

    def loss(self, params: dict[str, torch.Tensor], X: torch.Tensor,
             target: torch.Tensor) -> torch.Tensor:
        """The config's loss of ``Z_N`` per sample, averaged over the batch."""
        layers = self._layers(params)
        return self.modules[-1].loss(layers[-1], self._inputs(layers, X)[-1], target)

    def _cotangents(self, layers: list[dict], inputs: list[torch.Tensor],
                    target: torch.Tensor) -> list[torch.Tensor | None]:
        """Per block ``k < N-1``, the cotangent ``∂ℓ_b/∂Z`` of its output per sample (shaped
        as ``X``); ``None`` for the top block, whose loss is the config's own."""
        shape = inputs[0].shape
        g: list[torch.Tensor | None] = [None] * self.depth
        for k in range(self.depth - 2, -1, -1):
            cotangent = target if k == self.depth - 2 else g[k + 1]
            g[k] = self.modules[k + 1].gradient(layers[k + 1], inputs[k + 1], cotangent,
                                                wrt="X").reshape(shape)
        return g

    def gradient(self, params: dict[str, torch.Tensor], X: torch.Tensor,
                 target: torch.Tensor) -> torch.Tensor:
        """The loss's gradient over every parameter in ``PARAMS`` order, ``(n,)``."""
        layers = self._layers(params)
        inputs = self._inputs(layers, X)
        g = self._cotangents(layers, inputs, target)
        parts = [module.gradient(params, x, cotangent) for module, params, x, cotangent in
                 zip(self.modules, layers, inputs, [*g[:-1], target])]
        return torch.cat(parts)

    def _jacobians(self, layers: list[dict], inputs: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per block, ``J_X`` ``(B, L·d, L·d)`` and ``J_θ`` ``(B, L·d, n_θ)``."""
        J_X = [m.jacobian(p, x, "X") for m, p, x in zip(self.modules, layers, inputs)]
        J_theta = [torch.cat([m.jacobian(p, x, name) for name in names], dim=-1)
                   for m, p, x, names in zip(self.modules, layers, inputs, self.part_params)]
        return J_X, J_theta

    def loss_hessian(self, params: dict[str, torch.Tensor], X: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor:
        """The loss Hessian over every parameter, ``(n, n)`` in ``PARAMS`` order (its
        ``(n_θ × n_θ)`` blocks arranged by layer)."""
        layers = self._layers(params)
        inputs = self._inputs(layers, X)
        g = self._cotangents(layers, inputs, target)
        J_X, J_theta = self._jacobians(layers, inputs)
        batch, sizes = X.shape[0], [J.shape[-1] for J in J_theta]
        offsets = [sum(sizes[:k]) for k in range(self.depth + 1)]
        H = torch.zeros(offsets[-1], offsets[-1], dtype=X.dtype, device=X.device)
        M = None  # ∂²ℓ_b/∂Z_k², per sample, for the block above
        for k in range(self.depth - 1, -1, -1):
            module = self.modules[k]
            cotangent = target if k == self.depth - 1 else g[k]
            H_XX = module.loss_hessian(layers[k], inputs[k], cotangent, wrt="X")
            H_Xt = module.loss_hessian_mixed(layers[k], inputs[k], cotangent)
            H_tt = module.loss_hessian(layers[k], inputs[k], cotangent)
            if M is not None:  # the curvature from above, carried through this block
                MJ_X, MJ_t = M @ J_X[k], M @ J_theta[k]
                H_XX = H_XX + J_X[k].transpose(1, 2) @ MJ_X
                H_Xt = H_Xt + J_X[k].transpose(1, 2) @ MJ_t
                H_tt = H_tt + (J_theta[k].transpose(1, 2) @ MJ_t).mean(0)
            rows = slice(offsets[k], offsets[k + 1])
            H[rows, rows] = H_tt
            carried = H_Xt  # ∂²ℓ_b/∂Z_a∂θ_k for the output Z_a of each block a below
            for a in range(k - 1, -1, -1):
                block = torch.einsum("bri,brj->ij", J_theta[a], carried) / batch
                H[offsets[a]:offsets[a + 1], rows] = block
                H[rows, offsets[a]:offsets[a + 1]] = block.T
                if a:
                    carried = J_X[a].transpose(1, 2) @ carried
            M = H_XX
        return H


class Stack(Chain):
    """``depth`` blocks of ``config``, parameters ``"<layer>.<name>"`` (``"0.W_Q"``)."""

    def __init__(self, config: Config, depth: int) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
        super().__init__([(str(k), config) for k in range(depth)])
        self.top = self.modules[-1]
        self.block_params = self.part_params[-1]
