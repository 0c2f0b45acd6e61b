"""A whole model's routes to its gradient, HVP and Gauss–Newton product: curvgap's
(``curvgap.curvature``) and autograd's on the module itself (backward, double backward with
the MATH attention kernel, ``torch.func`` jvp + vjp, curvlinops' GGN), each a zero-argument
callable the benchmarks time alike; and how a call's time and peak memory are read."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..adapters import curvature


@dataclass
class Model:
    """A module, its input ``X`` (or ``None`` with the input among ``inputs``), its target
    and loss, as ``curvgap.curvature`` and autograd both take them."""

    name: str
    module: torch.nn.Module
    X: torch.Tensor | None
    T: torch.Tensor
    loss: str = "mse"
    inputs: dict = field(default_factory=dict)
    #: whether curvlinops' GGN takes it (its loss over (B, L, classes) logits does not)
    curvlinops: bool = True



class Routes:
    """curvgap's and autograd's gradient, HVP and Gauss–Newton product of one model."""

    def __init__(self, model: Model, fused: bool = False) -> None:
        self.model = model
        self.params = dict(model.module.named_parameters())
        self.curvature = curvature(model.module, model.loss, fused)
        n = sum(p.numel() for p in self.params.values())
        like = next(iter(self.params.values()))
        self.v = torch.randn(n, generator=torch.Generator().manual_seed(2),
                             dtype=like.dtype).to(like.device) * 0.01

    # -- the module itself -------------------------------------------------------------------
    def _output(self, params: dict | None = None) -> torch.Tensor:
        m = self.model
        args = () if m.X is None else (m.X,)
        if params is None:
            out = m.module(*args, **m.inputs)
        else:
            out = torch.func.functional_call(m.module, params, args, m.inputs)
        return out if isinstance(out, torch.Tensor) else out[0]

    def _loss_of(self, out: torch.Tensor) -> torch.Tensor:
        if self.model.loss == "mse":
            return F.mse_loss(out, self.model.T)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), self.model.T.reshape(-1))

    def _flat(self, grads: tuple) -> torch.Tensor:
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                          for g, p in zip(grads, self.params.values())])

    def _pieces(self, v: torch.Tensor) -> dict:
        out, offset = {}, 0
        for name, p in self.params.items():
            out[name] = v[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return out

    # -- autograd ---------------------------------------------------------------------------
    def backward(self) -> torch.Tensor:
        return self._flat(torch.autograd.grad(self._loss_of(self._output()),
                                              list(self.params.values()), allow_unused=True))

    def double_backward(self, v: torch.Tensor | None = None) -> torch.Tensor:
        """One HVP by double backward: the gradient graph, then one backward pass through it."""
        return self.retained_double_backward()(self.v if v is None else v)

    def retained_double_backward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """HVPs at this point on one gradient graph, built once and kept (as PyHessian
        does for Lanczos): each product is one backward pass through it."""
        params = list(self.params.values())
        with sdpa_kernel(SDPBackend.MATH):
            grads = torch.autograd.grad(self._loss_of(self._output()), params,
                                        create_graph=True, allow_unused=True)
        kept = [(g, k) for k, g in enumerate(grads) if g is not None]

        def product(v: torch.Tensor) -> torch.Tensor:
            pieces = list(self._pieces(v).values())
            values = torch.autograd.grad([g for g, _ in kept], params,
                                         [pieces[k] for _, k in kept], retain_graph=True,
                                         allow_unused=True)
            return self._flat(values)
        return product

    def jvp_vjp(self) -> torch.Tensor:
        """``J^T (∂²ℓ/∂Z²) J v`` by ``torch.func``: jvp, the loss's curvature along it (double
        backward of the loss in the output), vjp."""
        params = {k: p.detach() for k, p in self.params.items()}
        with sdpa_kernel(SDPBackend.MATH):  # the fused kernels have no forward mode
            out, tangent = torch.func.jvp(self._output, (params,), (self._pieces(self.v),))
            out = out.detach().requires_grad_(True)
            (slope,) = torch.autograd.grad(self._loss_of(out), out, create_graph=True)
            (curved,) = torch.autograd.grad(slope, out, tangent)
            _, pullback = torch.func.vjp(self._output, params)
        return torch.cat([g.reshape(-1) for g in pullback(curved)[0].values()])

    # -- curvgap ----------------------------------------------------------------------------
    def _args(self) -> tuple:
        m = self.model
        return (m.X, m.T)

    def gradient(self) -> torch.Tensor:
        return self.curvature.gradient(*self._args(), **self.model.inputs)

    def hvp(self) -> torch.Tensor:
        return self.curvature.hvp(*self._args(), self.v, **self.model.inputs)

    def gnvp(self) -> torch.Tensor:
        return self.curvature.gnvp(*self._args(), self.v, **self.model.inputs)

    @functools.cached_property
    def _gauss_newton(self) -> Any:
        return self.curvature.hessian_operator(*self._args(), part="gauss_newton",
                                               **self.model.inputs)

    def gn_operator(self) -> torch.Tensor:
        """One product of curvgap's Gauss–Newton operator at this point, which keeps the
        point's forward values from its first product on."""
        return self._gauss_newton @ self.v

    # -- curvlinops -------------------------------------------------------------------------
    @functools.cached_property
    def _curvlinops(self) -> tuple[Any, torch.Tensor]:
        """curvlinops' ``GGNLinearOperator`` over the parameters the loss depends on (its
        ``vmap`` cannot return an unused parameter's zeros), and their mask in ``v``."""
        from curvlinops import GGNLinearOperator

        params = list(self.params.values())
        with sdpa_kernel(SDPBackend.MATH):
            grads = torch.autograd.grad(self._loss_of(self._output()), params, allow_unused=True)
        used = torch.cat([torch.full((p.numel(),), g is not None, device=p.device)
                          for p, g in zip(params, grads)])
        m = self.model
        X = m.X if m.X is not None else m.inputs["inputs_embeds"]
        loss = torch.nn.MSELoss() if m.loss == "mse" else torch.nn.CrossEntropyLoss()
        operator = GGNLinearOperator(_OfItsInput(m), loss,
                                     [p for p, g in zip(params, grads) if g is not None],
                                     [(X, m.T)], progressbar=False, check_deterministic=False)
        return operator, used

    def curvlinops_ggn(self) -> torch.Tensor:
        """curvlinops' GGN matvec of ``v`` (zero on the parameters the loss ignores)."""
        operator, used = self._curvlinops
        with sdpa_kernel(SDPBackend.MATH):  # the fused kernels have no forward mode
            return torch.zeros_like(self.v).masked_scatter(used, operator @ self.v[used])


class _OfItsInput(torch.nn.Module):
    """A model's module as a function of its input alone, as curvlinops calls a model."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.inner, self.inputs, self.embedded = model.module, model.inputs, model.X is None

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        out = (self.inner(**{**self.inputs, "inputs_embeds": X}) if self.embedded
               else self.inner(X, **self.inputs))
        return out if isinstance(out, torch.Tensor) else out[0]


def synchronized(fn: Callable, device: str) -> Callable:
    """``fn`` that returns once the device has finished its work (for timing on a GPU)."""
    if device == "cpu":
        return fn

    def run() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out
    return run


def peak_memory(fn: Callable, device: str = "cpu") -> float | None:
    """The most memory (GB) that running ``fn`` adds above what is held before it: on a GPU
    the peak of torch's allocations; on the CPU the peak resident set (Linux: reset through
    ``/proc/self/clear_refs``); None where that cannot be read."""
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**30
    try:
        _trim()  # memory freed earlier goes back to the system first, so the peak shows
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        fn()
        return max(0.0, (_status("VmHWM") - before) / 2**20)
    except OSError:
        return None


def _trim() -> None:
    """Return the C allocator's free memory to the system (glibc's ``malloc_trim``), where
    there is one: else a route's arrays could reuse it and no peak would show."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status(key: str) -> int:
    """A ``/proc/self/status`` entry, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖``."""
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


