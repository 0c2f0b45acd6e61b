"""Curvature as a linear operator: ``H @ V`` without forming ``H``.

A :class:`CurvatureOperator` multiplies the loss Hessian, its Gauss–Newton part
``J^T (∂²ℓ/∂Z²) J`` or its functional part (the rest) onto a vector ``(n,)`` or the columns
of a matrix ``(n, k)`` through the generated ``hvp`` and ``gnvp``, all ``k`` columns in one
call (one forward pass for all of them). It follows the interface of curvlinops'
``PyTorchLinearOperator`` (``@``, ``.shape``, ``.dtype``, ``.device``, ``.adjoint()``,
``.to_scipy()``), so curvlinops' estimators (``hutchinson_trace``, ``xtrace``,
``hutchinson_diag``, ``lanczos_approximate_spectrum``) and scipy's solvers
(``scipy.sparse.linalg.eigsh``) take it as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .._extras import require
from ..runtime.loading import checks


class CurvatureOperator:
    """The symmetric ``n × n`` operator ``V ↦ product(V)``, ``V`` of shape ``(n,)`` or
    ``(n, k)`` (torch tensors in ``dtype`` on ``device``)."""

    SELF_ADJOINT = True

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], n: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self._product = product
        self.shape = (n, n)
        self._dtype, self._device = dtype, torch.device(device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def __matmul__(self, V: torch.Tensor) -> torch.Tensor:
        """``H V`` for ``V`` of shape ``(n,)`` or ``(n, k)``, in ``V``'s layout."""
        if not isinstance(V, torch.Tensor):
            raise TypeError(f"V: expected a torch tensor of shape ({self.shape[1]},) or "
                            f"({self.shape[1]}, k), got {type(V).__name__}")
        if V.ndim not in (1, 2) or V.shape[0] != self.shape[1]:
            raise ValueError(f"V: expected shape ({self.shape[1]},) or ({self.shape[1]}, k), "
                             f"got shape {tuple(V.shape)}")
        if V.ndim == 2 and V.shape[1] == 0:
            return V.new_zeros(self.shape[0], 0)
        return self._product(V.to(self._dtype))

    def adjoint(self) -> CurvatureOperator:
        """The operator itself (a Hessian is symmetric)."""
        return self

    def to_scipy(self, dtype: Any = None) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` multiplying in torch (numpy arrays in
        and out), for scipy's solvers such as ``eigsh``; :class:`ImportError` naming the
        ``operators`` extra without scipy."""
        linalg = require("scipy.sparse.linalg", "to_scipy()", "operators")

        def multiply(V: np.ndarray) -> np.ndarray:
            result = self @ torch.as_tensor(np.asarray(V), dtype=self._dtype,
                                            device=self._device)
            return result.detach().cpu().numpy()

        return linalg.LinearOperator(self.shape, matvec=multiply, rmatvec=multiply,
                                     matmat=multiply, rmatmat=multiply,
                                     dtype=np.dtype(dtype) if dtype is not None else np.float64)


def check_part(part: str) -> str:
    """``part`` if it is a loss-Hessian part, else ValueError (the generated modules' check)."""
    return checks("torch")._check_part(part)


def part_product(hvp: Callable[[torch.Tensor], torch.Tensor],
                 gnvp: Callable[[torch.Tensor], torch.Tensor], part: str
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product of ``part``: ``hvp``, ``gnvp``, or their difference (the functional
    part)."""
    if check_part(part) == "full":
        return hvp
    if part == "gauss_newton":
        return gnvp
    return lambda V: hvp(V) - gnvp(V)


def hessian_operator(module: ModuleType, params: dict, X: Any, target: Any,
                     wrt: str | list[str] | None = None, part: str = "full"
                     ) -> CurvatureOperator:
    """The loss Hessian of a generated ``module`` (torch or numpy) over the parameters
    ``wrt`` (default: all of ``PARAMS``; the ``wrt`` blocks of ``vec_r`` concatenated) as
    a :class:`CurvatureOperator`, for ``part`` ``"full"``, ``"gauss_newton"`` or
    ``"functional"``; torch tensors in and out (a numpy module computes in numpy)."""
    names = [name for name, _ in module.PARAMS] if wrt is None else (
        [wrt] if isinstance(wrt, str) else list(wrt))
    if "X" in names:
        raise ValueError("wrt: expected parameter names (an operator acts on the parameters; "
                         "for the input per sample use the module's hvp with wrt='X'), got "
                         f"{names}")
    gradient = module.gradient(params, X, target, wrt=names)  # checks every argument
    numpy_module = isinstance(gradient, np.ndarray)
    n = int(gradient.shape[0])
    dtype = torch.from_numpy(gradient).dtype if numpy_module else gradient.dtype
    device = torch.device("cpu") if numpy_module else gradient.device

    def call(function: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        if not numpy_module:
            return lambda V: function(params, X, target, V, wrt=names)
        return lambda V: torch.as_tensor(function(params, X, target, V.cpu().numpy(),
                                                  wrt=names))

    product = part_product(call(module.hvp), call(module.gnvp), part)
    return CurvatureOperator(product, n, dtype, device)
