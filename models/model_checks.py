"""Proof by numbers for a model config: its :class:`~curvgap.models.Model` (the chained
generated modules, ties included) against autograd on the plain-PyTorch model composed of
each part's reference forward (:func:`curvgap.codegen.verify.reference_output`), which reads
a tied parameter in each of its places."""

from __future__ import annotations

import numpy as np
import torch

from ..codegen import backends
from ..codegen.verify import reference_loss, reference_output, relative_error
from .model import Model
from .model_config import ModelConfig


def model_dims(config: ModelConfig, dims: dict[str, int]) -> dict[str, int]:
    """``dims`` as a model of ``config`` needs them: a tied head's classes are the
    vocabulary (``c = p``)."""
    return {**dims, "c": dims["p"]} if config.tie_embeddings else dict(dims)


def check_model(config: ModelConfig, backend: str, dims: dict[str, int], batch: int = 2,
                seed: int = 0) -> dict[str, float]:
    """Relative errors of the model's forward, loss, gradient, loss Hessian with its
    Gauss–Newton part, HVP and GN products (a vector and a matrix of 2) and the diagonal
    over its untied parameters, against autograd (float64)."""
    model = Model(config, backend=backend)
    dims = model_dims(config, dims)
    gen = torch.Generator().manual_seed(seed)
    params = {name: 0.6 * torch.randn(shape, generator=gen, dtype=torch.float64)
              + (1.0 if name.rsplit(".", 1)[-1].startswith("gamma") else 0.0)
              for name, shape in model.parameter_shapes(dims).items()}
    features = dims["p"] if config.embedding and config.embedding.projection else dims["d"]
    X = torch.randn(batch, dims["L"], features, generator=gen, dtype=torch.float64)
    parts = config.parts()
    names, sizes = model.PARAMS, [params[n].numel() for n in model.PARAMS]

    def outputs(vector: torch.Tensor) -> torch.Tensor:
        values = {n: v.reshape(params[n].shape) for n, v in zip(names, torch.split(vector, sizes))}
        for tied, source in model.ties.items():
            values[tied] = values[source].T if tied in model.transposed else values[source]
        rows = []
        for x in X:
            for (prefix, part), part_names in zip(parts, model.part_params):
                x = reference_output(part, {n: values[f"{prefix}.{n}"] for n in part_names}, x)
            rows.append(x)
        return torch.stack(rows)

    flat = torch.cat([params[n].reshape(-1) for n in names])
    Z = outputs(flat)
    if config.loss == "cross_entropy":
        T = torch.randint(0, Z.shape[-1], Z.shape[:-1], generator=gen)
    else:
        T = torch.randn(Z.shape, generator=gen, dtype=torch.float64)
    top = parts[-1][1]

    def loss(vector: torch.Tensor) -> torch.Tensor:
        return sum(reference_loss(top, z, t) for z, t in zip(outputs(vector), T)) / batch

    F = torch.autograd.functional
    H = F.hessian(loss, flat, vectorize=True)
    J = F.jacobian(outputs, flat, vectorize=True).reshape(batch, -1, flat.numel())
    curvature = torch.stack([F.hessian(lambda z, t=t: reference_loss(top, z, t), z)
                             .reshape(J.shape[1], J.shape[1]) for z, t in zip(Z, T)])
    gauss_newton = torch.einsum("bri,brs,bsj->ij", J, curvature, J) / batch
    V = torch.randn(flat.numel(), 2, generator=gen, dtype=torch.float64)
    conv = backends.backend(backend).from_torch
    P, Xb, Tb, Vb = {k: conv(v) for k, v in params.items()}, conv(X), conv(T), conv(V)
    errors = {"forward": relative_error(model.forward(P, Xb), Z),
              "loss": relative_error(model.loss(P, Xb, Tb), loss(flat)),
              "gradient": relative_error(model.gradient(P, Xb, Tb), F.jacobian(loss, flat)),
              "loss_hessian": relative_error(model.loss_hessian(P, Xb, Tb), H),
              "loss_hessian.gauss_newton": relative_error(
                  model.loss_hessian(P, Xb, Tb, part="gauss_newton"), gauss_newton),
              "hvp": relative_error(model.hvp(P, Xb, Tb, Vb[:, 0]), H @ V[:, 0]),
              "hvp.matrix": relative_error(model.hvp(P, Xb, Tb, Vb), H @ V),
              "gnvp.matrix": relative_error(model.gnvp(P, Xb, Tb, Vb), gauss_newton @ V)}
    untied = [n for n in names if n not in model.ties.values()]
    kept = np.concatenate([np.arange(sum(sizes[:names.index(n)]), sum(sizes[:names.index(n) + 1]))
                           for n in untied])
    errors["diagonal"] = relative_error(model.diagonal(P, Xb, Tb, wrt=untied),
                                        torch.diagonal(H)[kept], torch.diagonal(H))
    return errors
