"""The competing routes to each quantity: generated code, ``torch.func`` and curvlinops.

Every route is a zero-argument callable returning the quantity, so the runner can time
them alike; the autograd routes differentiate the plain PyTorch forward pass of
:mod:`curvgap.codegen.verify` (no engine code).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from .._extras import require
from ..codegen import backends
from ..codegen.verify import batch_loss, reference_output, sample_loss
from ..derivations.config import Config


class ReferenceModel(torch.nn.Module):
    """The configured sublayer as an ``nn.Module`` over a batch (for curvlinops)."""

    def __init__(self, config: Config, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.names = list(params)
        for name, value in params.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        params = {name: getattr(self, name) for name in self.names}
        return vmap(lambda x: reference_output(self.config, params, x))(X)


class Routes:
    """Callables for one case: ``params``, input ``X``, ``target`` and direction ``v``."""

    def __init__(self, config: Config, modules: dict[str, ModuleType], params: dict,
                 X: torch.Tensor, target: torch.Tensor, v: torch.Tensor) -> None:
        self.config, self.params, self.X, self.target, self.v = config, params, X, target, v
        self.modules = modules  # backend name -> generated module
        self.names = [name for name, _ in modules["torch"].PARAMS]
        self.model = ReferenceModel(config, params)

    # -- curvgap ------------------------------------------------------------------------
    def curvgap(self, backend: str, function: str, **kwargs) -> Callable:
        """The generated module of ``backend`` computing ``function`` on this case (its
        arguments converted beforehand)."""
        module, convert = self.modules[backend], backends.backend(backend).from_torch
        args = ({k: convert(t) for k, t in self.params.items()}, convert(self.X),
                convert(self.target))
        if function == "jacobian":
            return lambda: [module.jacobian(args[0], args[1], name) for name in self.names]
        if function == "hvp":
            v = convert(self.v)
            return lambda: module.hvp(*args, v)
        return lambda: module.loss_hessian(*args, **kwargs)

    def curvgaps(self, function: str, **kwargs) -> dict[str, Callable]:
        """:meth:`curvgap` for every module backend, named ``curvgap <backend>``."""
        return {f"curvgap {name}": self.curvgap(name, function, **kwargs)
                for name in self.modules}

    # -- torch.func -----------------------------------------------------------------------
    def _batch_loss(self, params: dict) -> torch.Tensor:
        return batch_loss(self.config, params, self.X, self.target)

    def hessian_batch(self, names: list[str] | None = None) -> Callable:
        """``torch.func.hessian`` of the batch loss over ``names`` (a dict of blocks)."""
        names = names or self.names
        fixed = {k: v for k, v in self.params.items() if k not in names}
        return lambda: hessian(lambda p: self._batch_loss({**fixed, **p}))(
            {k: self.params[k] for k in names})

    def hessian_per_sample(self, chunk: int | None = None) -> Callable:
        """``torch.func.hessian`` of each sample's loss (all samples in one ``vmap``, or
        ``chunk`` at a time when memory is short), stacked."""
        def one(p, x, t):
            return sample_loss(self.config, p, x, t)
        per_sample = vmap(hessian(one), in_dims=(None, 0, 0))
        if chunk is None:
            return lambda: per_sample(self.params, self.X, self.target)
        starts = range(0, self.X.shape[0], chunk)
        return lambda: [per_sample(self.params, self.X[s:s + chunk], self.target[s:s + chunk])
                        for s in starts]

    def jacobian(self, mode: str) -> Callable:
        """``vmap(jacrev)`` or ``vmap(jacfwd)`` of the output in every parameter."""
        transform = jacrev if mode == "jacrev" else jacfwd
        def sample(p, x):
            return reference_output(self.config, p, x)
        return lambda: vmap(transform(sample), in_dims=(None, 0))(self.params, self.X)

    def write_floor(self) -> Callable:
        """What any route to the Jacobians pays at least: allocating arrays of their size
        and writing every entry once (fresh memory costs a page fault per 4 KiB)."""
        with torch.no_grad():
            n = self.model(self.X[:1]).numel()
        shapes = [(self.X.shape[0], n, self.params[k].numel()) for k in self.names]
        return lambda: [torch.empty(shape, dtype=self.X.dtype).fill_(0.0) for shape in shapes]

    def _split(self) -> dict:
        sizes = [self.params[k].numel() for k in self.names]
        return {k: part.reshape(self.params[k].shape)
                for k, part in zip(self.names, torch.split(self.v, sizes))}

    def hvp_jvp_of_grad(self) -> Callable:
        direction = self._split()
        return lambda: jvp(grad(self._batch_loss), (self.params,), (direction,))[1]

    def hvp_double_backward(self) -> Callable:
        direction = self._split()

        def run():
            params = {k: t.detach().requires_grad_() for k, t in self.params.items()}
            grads = torch.autograd.grad(self._batch_loss(params), list(params.values()),
                                        create_graph=True)
            dot = sum((g * direction[k]).sum() for g, k in zip(grads, params))
            return torch.autograd.grad(dot, list(params.values()))
        return run

    # -- curvlinops -----------------------------------------------------------------------
    def curvlinops_operator(self):
        curvlinops = require("curvlinops", "the curvlinops comparison")
        data = [(self.X, self.target)]
        loss = (torch.nn.MSELoss() if self.config.loss == "mse" else None)
        if loss is None:
            return None
        return curvlinops.HessianLinearOperator(self.model, loss, list(self.model.parameters()),
                                                data, progressbar=False,
                                                check_deterministic=False)

    def curvlinops_matvec(self) -> Callable | None:
        operator = self.curvlinops_operator()
        return None if operator is None else (lambda: operator @ self.v)

    def curvlinops_dense(self) -> Callable | None:
        operator = self.curvlinops_operator()
        if operator is None:
            return None
        identity = torch.eye(self.v.numel(), dtype=self.v.dtype)
        return lambda: operator @ identity
