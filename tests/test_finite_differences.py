"""A second, independent reference: float64 central finite differences of the generated
forward pass and loss (no autograd), on small cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SHIPPED, as_numpy, generated_module, to_backend

from curvgap.codegen.verify import random_case

H1, H2 = 1e-6, 1e-4          # steps for first and second differences
TOL1, TOL2 = 1e-7, 1e-5      # their truncation and rounding error, relative to the scale


def _flat_functions(module, backend, params, X, target, wrt):
    """forward and loss as functions of the flattened ``wrt`` variable."""
    base = {"X": X, **params}
    shape = base[wrt].shape

    def unflatten(vector):
        values = dict(base)
        values[wrt] = torch.as_tensor(vector).reshape(shape)
        P = to_backend(backend, {k: v for k, v in values.items() if k != "X"})
        return P, to_backend(backend, values["X"])

    def forward(vector):
        P, Xb = unflatten(vector)
        return as_numpy(module.forward(P, Xb)).reshape(X.shape[0], -1)

    def loss(vector):
        P, Xb = unflatten(vector)
        return float(module.loss(P, Xb, to_backend(backend, target)))

    return forward, loss, base[wrt].reshape(-1).numpy().copy()


def second(f, point, a, b):
    """Central second difference of ``f`` at ``point`` along ``a`` and ``b``."""
    return (f(point + H2 * (a + b)) - f(point + H2 * (a - b))
            - f(point - H2 * (a - b)) + f(point - H2 * (a + b))) / (4 * H2 * H2)


def _relative(value, reference, floor=0.0):
    """Max error over the larger of the reference's scale and ``floor`` (the size of the
    differenced function: where the reference vanishes, rounding error still scales so)."""
    scale = max(np.abs(reference).max(), floor)
    return np.abs(np.asarray(value) - reference).max() / scale


#: Configs whose finite differences take 10-35 s each: checked in the slow run (the quick run
#: keeps paper_block, of which paper_block_eps differs only by its eps).
SLOW = {"gpt2_block", "rmsnorm_block", "paper_block_eps"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(SHIPPED)])
def test_jacobian_and_hessians_match_finite_differences(name, backend):
    module = generated_module(name, backend)
    params, X, target = random_case(module, {"L": 2, "d": 4, "d_k": 3, "d_ff": 5, "p": 6, "c": 7}, batch=2, seed=7)
    P, Xb, Tb = to_backend(backend, params), to_backend(backend, X), to_backend(backend, target)
    for wrt in [n for n, _ in module.PARAMS] + ["X"]:
        forward, loss, point = _flat_functions(module, backend, params, X[:1] if wrt == "X"
                                               else X, target[:1] if wrt == "X" else target, wrt)
        n = point.size
        basis = np.eye(n)
        fd_jac = np.stack([(forward(point + H1 * e) - forward(point - H1 * e)) / (2 * H1)
                           for e in basis], axis=-1)
        Xj = Xb[:1] if wrt == "X" else Xb
        assert _relative(as_numpy(module.jacobian(P, Xj, wrt)), fd_jac) < TOL1

        fd_out = np.stack([np.stack([second(forward, point, a, b) for b in basis], -1)
                           for a in basis], -2)          # (B, L·d, n, n)
        out = as_numpy(module.output_hessian(P, Xj, wrt, wrt))
        size = np.abs(forward(point)).max()
        assert _relative(out.reshape(fd_out.shape), fd_out, size) < TOL2
        fd_loss = np.array([[second(loss, point, a, b) for b in basis] for a in basis])
        Tj = Tb[:1] if wrt == "X" else Tb
        lh = as_numpy(module.loss_hessian(P, Xj, Tj, wrt=wrt))
        assert _relative(lh.reshape(n, n), fd_loss, loss(point)) < TOL2
