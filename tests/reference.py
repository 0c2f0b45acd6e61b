"""References for real modules: reverse-over-reverse autograd on the module itself under the
MATH attention kernel (the one with second derivatives), backed by central finite
differences of its gradient. Nothing here calls curvgap."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvgap.benchmarks.twin import float64_twin


def main_output(out: Any) -> torch.Tensor:
    """A module's main output: the first element of a tuple, ``last_hidden_state`` or
    ``logits`` of a model output."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return main_output(out[0])
    for name in ("last_hidden_state", "logits"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return main_output(out[0])


def losses(name: str | Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss ``name`` of the output and the target (a callable: as it is, such as a
    model's own loss of its logits)."""
    if callable(name):
        return name
    if name == "mse":
        return F.mse_loss
    return lambda Z, T: F.cross_entropy(Z.reshape(-1, Z.shape[-1]), T.reshape(-1))


class Reference:
    """``loss(module(X, **inputs), T)`` and its derivatives by autograd, parameters in the
    module's order (``wrt`` names a subset)."""

    def __init__(self, module: torch.nn.Module, X: torch.Tensor, T: torch.Tensor,
                 loss: str | Callable = "mse", wrt: list[str] | None = None, twin: bool = False,
                 **inputs: Any) -> None:
        # the input on the path too (its float32 casts are the twin's to keep in float64)
        def marked(value: Any) -> Any:
            return (value.detach().requires_grad_(True)
                    if isinstance(value, torch.Tensor) and value.is_floating_point() else value)

        if "inputs_embeds" in inputs:
            inputs = {**inputs, "inputs_embeds": marked(inputs["inputs_embeds"])}
        self.module, self.X, self.T, self.inputs = module, marked(X), T, inputs
        self.twin = twin
        self.loss_fn = losses(loss)
        named = dict(module.named_parameters())
        self.names = wrt or list(named)
        self.params = [named[n] for n in self.names]

    def output(self, X: torch.Tensor | None = None) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            return main_output(self.module(self.X if X is None else X, **self.inputs))

    def loss(self) -> torch.Tensor:
        with float64_twin(self.twin):
            return self.loss_fn(self.output(), self.T)

    def _gradient(self, create_graph: bool) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            grads = torch.autograd.grad(self.loss(), self.params, create_graph=create_graph,
                                        allow_unused=True, materialize_grads=True)
        return torch.cat([g.reshape(-1) for g in grads])

    def gradient(self) -> torch.Tensor:
        return self._gradient(False).detach()

    def hessian(self) -> torch.Tensor:
        """Each row the gradient of one gradient entry (reverse over reverse)."""
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            flat = self._gradient(True)
            rows = []
            for k in range(flat.numel()):
                if not flat[k].requires_grad:
                    rows.append(torch.zeros_like(flat))
                    continue
                grads = torch.autograd.grad(flat[k], self.params, retain_graph=True,
                                            allow_unused=True, materialize_grads=True)
                rows.append(torch.cat([g.reshape(-1) for g in grads]))
        return torch.stack(rows).detach()

    def diagonal(self, chunk: int = 256) -> torch.Tensor:
        """The Hessian's diagonal by reverse over reverse, ``chunk`` rows of the Hessian at
        once (the gradient's backward pass batched over unit cotangents), each row's own
        entry kept: the rows of :meth:`hessian` without one backward pass per row."""
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            flat = self._gradient(True)
            n, parts = flat.numel(), []
            if not flat.requires_grad:
                return torch.zeros_like(flat).detach()
            for start in range(0, n, chunk):
                rows = torch.arange(start, min(start + chunk, n))
                units = torch.zeros(len(rows), n, dtype=flat.dtype, device=flat.device)
                units[torch.arange(len(rows)), rows] = 1
                grads = torch.autograd.grad(flat, self.params, units, retain_graph=True,
                                            allow_unused=True, is_grads_batched=True)
                # (a parameter the loss does not read has no rows: zeros, unbatched
                # where materialized by autograd)
                block = torch.cat([flat.new_zeros(len(rows), p.numel()) if g is None
                                   else g.reshape(len(rows), -1)
                                   for g, p in zip(grads, self.params)], 1)
                parts.append(block[torch.arange(len(rows)), rows])
        return torch.cat(parts).detach()

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            flat = self._gradient(True)
            grads = torch.autograd.grad(flat @ v, self.params, allow_unused=True,
                                        materialize_grads=True)
        return torch.cat([g.reshape(-1) for g in grads]).detach()

    def gnvp(self, v: torch.Tensor) -> torch.Tensor:
        """``J^T (∂²ℓ/∂Z²) J v`` by reverse mode only: ``J v`` as the derivative of
        ``(J^T g) · v`` in a dummy ``g``, the loss's curvature along it by double backward,
        then ``J^T`` by one more backward pass."""
        with sdpa_kernel(SDPBackend.MATH), float64_twin(self.twin):
            Z = main_output(self.module(self.X, **self.inputs))
            g = torch.zeros_like(Z, requires_grad=True)
            grads = torch.autograd.grad(Z, self.params, g, create_graph=True,
                                        allow_unused=True, materialize_grads=True)
            flat = torch.cat([x.reshape(-1) for x in grads])
            (Jv,) = torch.autograd.grad(flat @ v, g)
            out = Z.detach().requires_grad_(True)
            (dZ,) = torch.autograd.grad(self.loss_fn(out, self.T), out, create_graph=True)
            (HJv,) = torch.autograd.grad(dZ, out, Jv)
            grads = torch.autograd.grad(Z, self.params, HJv, allow_unused=True,
                                        materialize_grads=True)
        return torch.cat([x.reshape(-1) for x in grads]).detach()

    def gradient_fd(self, v: torch.Tensor, step: float = 1e-5) -> torch.Tensor:
        """``H v`` by central differences of the gradient along ``v``, Richardson-extrapolated
        (steps ``h`` and ``h/2``: error of order ``h⁴``)."""
        saved = [p.detach().clone() for p in self.params]

        def at(scale: float) -> torch.Tensor:
            with torch.no_grad():
                offset = 0
                for p in self.params:
                    p.add_(scale * v[offset:offset + p.numel()].reshape(p.shape))
                    offset += p.numel()
            try:
                return self.gradient()
            finally:
                with torch.no_grad():
                    for p, value in zip(self.params, saved):
                        p.copy_(value)

        def central(h: float) -> torch.Tensor:
            return (at(h) - at(-h)) / (2 * h)

        return (4 * central(step / 2) - central(step)) / 3


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |value - reference| / max |reference|``."""
    scale = reference.abs().max()
    return float((value - reference).abs().max() / (scale if scale > 0 else 1))


def randomise(module: torch.nn.Module, seed: int = 0, scale: float = 0.7) -> torch.nn.Module:
    """Random nonzero weights and biases (vectors around 0.5, so norms' weights too), eval
    mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.copy_(noise * scale + (0.5 if p.ndim == 1 else 0.0))
    return module.eval()
