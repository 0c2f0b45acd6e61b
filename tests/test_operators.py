"""Curvature operators of a generated module (``curvgap.operators.hessian_operator``): each
part's products with vectors and matrices, scipy's eigenvalues and the trace from the exact
diagonal against the ``torch.func`` Hessian of the same loss (float64), on both backends;
curvlinops' estimators taking the operator as it is; and the structured (Kronecker) blocks
against their dense autograd forms, on modules and on a real layer."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch
from conftest import extra_module

import curvgap
from curvgap.codegen.cache import module_for
from curvgap.codegen.generate import load_configs
from curvgap.codegen.verify import Reference, random_case
from curvgap.operators import hessian_operator, kronecker_block

#: one worker runs this file: its module-scoped fixtures are computed once
pytestmark = pytest.mark.xdist_group("operators")

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


def structured_case(name: str, backend: str, dims: dict):
    config = next(c for c in load_configs() if c.name == name)
    module = module_for(config, backend)
    params, X, T = random_case(module, dims, 3, seed=1)
    names = [n for n, _ in module.PARAMS]
    reference = Reference(config, module, params, X, T)
    dense = {"full": reference.loss_hessian(names), "gauss_newton": reference.gauss_newton(names)}
    if backend == "numpy":
        params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
    return module, params, X, T, names, dense


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("name, block", [("self_attention", "W_V"), ("ffn", "W_2")])
def test_structured_blocks_equal_their_dense_forms(name, block, backend):
    # L > d so that the block is invertible (its factor is a sum of L-row Gram matrices)
    module, params, X, T, names, dense = structured_case(
        name, backend, {"L": 7, "d": 4, "d_k": 3, "d_ff": 5})
    sizes = [int(np.prod(np.shape(params[n]))) for n in names]
    start = sum(sizes[:names.index(block)])
    rows = slice(start, start + sizes[names.index(block)])
    assert (block, block, "gauss_newton") in module.STRUCTURED
    for part in ("full", "gauss_newton"):
        expected = dense[part][rows, rows]
        structured = kronecker_block(module, params, X, T, block, part=part)
        assert structured.shape == expected.shape
        assert relative(structured.to_dense(), expected, expected) <= 1e-12
        V = torch.randn(expected.shape[0], 2, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64)
        assert relative(structured @ V, expected @ V, expected @ V) <= 1e-12
        values = torch.linalg.eigvalsh(expected)
        assert relative(structured.eigvalsh(), values, values) <= 1e-10
        solution = structured.solve(V)
        assert relative(expected @ solution, V, V) <= 1e-8 * float(values[-1] / values[0])


def test_unstructured_blocks_are_refused_naming_the_structured_ones():
    module, params, X, T, _, _ = structured_case("self_attention", "torch",
                                                 {"L": 3, "d": 4, "d_k": 2, "d_ff": 5})
    with pytest.raises(ValueError, match=r"wrt_i, wrt_j: expected a block of STRUCTURED "
                                         r"\[\('W_V', 'W_V', 'gauss_newton'\), \('W_V', 'W_V', "
                                         r"'full'\)\] .*got \('W_Q', 'W_Q', part='full'\)"):
        kronecker_block(module, params, X, T, "W_Q")
    structured = kronecker_block(module, params, X, T, "W_V")
    with pytest.raises(ValueError, match=r"v: expected shape \(16,\) or \(16, k\)"):
        structured @ torch.zeros(3, dtype=torch.float64)


def test_a_real_layers_structured_block_in_its_own_layout():
    """``linear2.weight`` in the layer's own layout ``(d, d_ff)``: its block is a Kronecker
    product as the layer holds it; ``linear1.weight``'s (behind the ReLU) is not."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(6, 2, dim_feedforward=5, dropout=0.0,
                                             batch_first=True, norm_first=True,
                                             dtype=torch.float64)
    c = curvgap.curvature(layer)
    X = torch.randn(2, 7, 6, dtype=torch.float64)
    T = torch.randn(2, 7, 6, dtype=torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        H = torch.autograd.functional.hessian(
            lambda w: torch.nn.functional.mse_loss(torch.func.functional_call(
                layer, {"linear2.weight": w.reshape(6, 5)}, (X,)), T),
            layer.linear2.weight.detach().reshape(-1))
    structured = c.kronecker_block(X, T, "linear2.weight")
    assert relative(structured.to_dense(), H, H) <= 1e-10
    assert relative(structured.eigvalsh(), torch.linalg.eigvalsh(H), H) <= 1e-10
    with pytest.raises(ValueError, match=r"expected a block that is exactly a sum of Kronecker "
                                         r"products in this module \(\(linear2.weight, "
                                         r"linear2.weight, 'gauss_newton'\), .*got "
                                         r"\(linear1.weight, linear1.weight, 'full'\)"):
        c.kronecker_block(X, T, "linear1.weight")
    with pytest.raises(ValueError, match=r"got \(self_attn.in_proj_weight, "):
        c.kronecker_block(X, T, "self_attn.in_proj_weight")


#: The blocks of the shipped configs that are exactly Kronecker products (README's table).
STRUCTURED = {"self_attention": [("W_V", "W_V")], "ffn": [("W_2", "W_2")],
              "rmsnorm_block": [("W_2", "W_2")],
              "patch_embedding": [("W_E", "W_E"), ("W_E", "P_E"), ("P_E", "P_E")]}


@pytest.mark.parametrize("config", sorted(c.name for c in load_configs()))
def test_the_structured_blocks_of_each_shipped_config(config):
    module = importlib.import_module(f"curvgap.generated.torch.{config}")
    expected = {(v, w, part) for v, w in STRUCTURED.get(config, [])
                for part in ("gauss_newton", "full")}
    assert set(module.STRUCTURED) == expected


def _block(name: str, block: str, dims: dict, part: str):
    """The structured block of ``block`` and the same block of the dense autograd Hessian."""
    module, params, X, T, names, dense = structured_case(name, "torch", dims)
    sizes = [int(np.prod(np.shape(params[n]))) for n in names]
    start = sum(sizes[:names.index(block)])
    rows = slice(start, start + sizes[names.index(block)])
    return kronecker_block(module, params, X, T, block, part=part), dense[part][rows, rows]


def residual(H: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(H @ x - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("part", ["full", "gauss_newton"])
def test_solve_refuses_a_singular_block_and_takes_a_named_damping(part):
    # B·L = 3·5 = 15 rows of activations for d_ff = 16: the factor of W_2 has rank 15 < 16
    structured, H = _block("ffn", "W_2", {"L": 5, "d": 4, "d_k": 3, "d_ff": 16}, part)
    n = H.shape[0]
    limit = 1 / (n * torch.finfo(torch.float64).eps)
    assert structured.condition() >= limit
    b = torch.randn(n, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"solve: expected a block that is invertible in "
                                         r"torch.float64, got A ⊗ B with condition number "
                                         r"(\S+) \(A: \S+, B: \S+\), at or above 7.04e\+13 = "
                                         r"1/\(p·q·eps\) where it is numerically singular: "
                                         r"pass damping > 0 to solve") as error:
        structured.solve(b)
    assert float(str(error.value).split("condition number ")[1].split()[0]) >= limit
    damping = 1e-3 * float(torch.linalg.eigvalsh(H)[-1])
    x = structured.solve(b, damping=damping)
    damped = H + damping * torch.eye(n, dtype=torch.float64)
    assert residual(damped, x, b) < 1e-10
    assert residual(damped, structured.solve(b[:, 0], damping=damping), b[:, 0]) < 1e-10


def test_solve_of_a_well_conditioned_block_is_exact():
    # B·L = 3·7 = 21 rows for d_ff = 5: invertible
    structured, H = _block("ffn", "W_2", {"L": 7, "d": 4, "d_k": 3, "d_ff": 5}, "full")
    assert structured.condition() < 1e8
    b = torch.randn(H.shape[0], 3, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    assert residual(H, structured.solve(b), b) < 1e-10
    assert residual(structured.to_dense(), structured.solve(b), b) < 1e-12
    x = structured.solve(b, damping=0.5)  # damped, through the factors' eigenvectors
    assert residual(H + 0.5 * torch.eye(H.shape[0], dtype=torch.float64), x, b) < 1e-10


@pytest.mark.parametrize("damping", [-1.0, float("nan"), float("inf"), True, "1e-3", None])
def test_a_bad_damping_is_refused(damping):
    structured, _ = _block("ffn", "W_2", {"L": 7, "d": 4, "d_k": 3, "d_ff": 5}, "full")
    with pytest.raises(ValueError, match=rf"damping: expected a finite number >= 0, got "
                                         rf"{re.escape(repr(damping))}"):
        structured.solve(torch.ones(structured.shape[0], dtype=torch.float64), damping=damping)
