"""Curvature operators of a generated module (``curvgap.operators.hessian_operator``): each
part's products with vectors and matrices, scipy's eigenvalues and the trace from the exact
diagonal against the ``torch.func`` Hessian of the same loss (float64), on both backends; and
curvlinops' estimators taking the operator as it is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import extra_module

from curvgap.codegen.cache import module_for
from curvgap.codegen.generate import load_configs
from curvgap.codegen.verify import Reference, random_case
from curvgap.operators import hessian_operator

DIMS = {"L": 3, "d": 4, "d_k": 2, "d_ff": 5}  # every size differs


@pytest.fixture(scope="module")
def case():
    config = next(c for c in load_configs() if c.name == "paper_block")
    module = module_for(config)
    params, X, T = random_case(module, DIMS, 2, seed=3)
    names = [name for name, _ in module.PARAMS]
    reference = Reference(config, module, params, X, T)
    full, gauss_newton = reference.loss_hessian(names), reference.gauss_newton(names)
    return config, params, X, T, {"full": full, "gauss_newton": gauss_newton,
                                  "functional": full - gauss_newton}


def relative(value, reference, scale) -> float:
    return float((torch.as_tensor(value) - reference).abs().max() / scale.abs().max())


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("part", ["full", "gauss_newton", "functional"])
def test_each_part_times_vectors_and_matrices(case, backend, part):
    config, params, X, T, dense = case
    module = module_for(config, backend)
    if backend == "numpy":
        params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
    operator = hessian_operator(module, params, X, T, part=part)
    n = dense["full"].shape[0]
    assert operator.shape == (n, n) and operator.dtype == torch.float64
    V = torch.randn(n, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert relative(operator @ V, dense[part] @ V, dense["full"] @ V) <= 1e-10
    assert relative(operator @ V[:, 0], dense[part] @ V[:, 0], dense["full"] @ V[:, 0]) <= 1e-10
    assert relative(operator @ torch.eye(n, dtype=torch.float64), dense[part],
                    dense["full"]) <= 1e-10
    diagonal = module.diagonal(params, X, T, part=part)
    assert relative(diagonal, torch.diagonal(dense[part]), torch.diagonal(dense["full"])) <= 1e-10


def test_eigenvalues_by_scipy_and_trace_by_the_diagonal(case):
    config, params, X, T, dense = case
    module = module_for(config)
    eigsh = extra_module("scipy.sparse.linalg").eigsh
    expected = torch.linalg.eigvalsh(dense["full"])
    operator = hessian_operator(module, params, X, T).to_scipy()
    for which, values in (("LA", expected[-3:]), ("SA", expected[:3])):
        found = np.sort(eigsh(operator, k=3, which=which, tol=1e-14)[0])
        assert float(np.abs(found - values.numpy()).max() / expected.abs().max()) <= 1e-10
    trace = float(module.diagonal(params, X, T).sum())
    assert abs(trace - float(torch.trace(dense["full"]))) <= 1e-10 * float(
        torch.diagonal(dense["full"]).abs().sum())


def test_curvlinops_estimators_take_the_operator(case):
    config, params, X, T, dense = case
    curvlinops = extra_module("curvlinops")
    operator = hessian_operator(module_for(config), params, X, T)
    n, exact = operator.shape[0], float(torch.trace(dense["full"]))
    torch.manual_seed(0)
    estimate = float(curvlinops.xtrace(operator, num_matvecs=n - 2))
    assert abs(estimate - exact) <= 1e-2 * float(torch.diagonal(dense["full"]).abs().sum())
    grid, density = curvlinops.lanczos_approximate_spectrum(operator, ncv=20, num_points=400)
    eigenvalues = torch.linalg.eigvalsh(dense["full"])
    assert float(grid[0]) <= float(eigenvalues[0]) and float(grid[-1]) >= float(eigenvalues[-1])
    assert abs(float(torch.trapezoid(density, grid)) - 1) <= 1e-2


def test_bad_operator_inputs_are_refused(case):
    config, params, X, T, _ = case
    module = module_for(config)
    with pytest.raises(ValueError, match=r"part: expected 'full', 'gauss_newton' or "
                                         r"'functional', got 'diag'"):
        hessian_operator(module, params, X, T, part="diag")
    with pytest.raises(ValueError, match=r"wrt: expected parameter names"):
        hessian_operator(module, params, X, T, wrt="X")
    operator = hessian_operator(module, params, X, T, wrt="W_V")
    with pytest.raises(ValueError, match=r"V: expected shape \(16,\) or \(16, k\), got shape "
                                         r"\(3,\)"):
        operator @ torch.zeros(3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"V: expected a torch tensor"):
        operator @ np.zeros(16)
