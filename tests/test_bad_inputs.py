"""Bad calls raise ValueError or TypeError naming the argument, the expectation and what
was given."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import generated_module, to_backend

from curvgap.codegen.verify import random_case


@pytest.fixture
def case(backend):
    module = generated_module("layernorm_affine", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4}, batch=2)
    return module, backend, params, X, target


def call(case, function="loss_hessian", **changes):
    module, backend, params, X, target = case
    args = {"params": params, "X": X, "target": target, **changes}
    args = {k: to_backend(backend, v) if isinstance(v, (torch.Tensor, dict)) else v
            for k, v in args.items()}
    if function == "forward":
        return module.forward(args["params"], args["X"])
    if function == "jacobian":
        return module.jacobian(args["params"], args["X"], args.get("wrt", "X"))
    return module.loss_hessian(args["params"], args["X"], args["target"],
                               wrt=args.get("wrt"), part=args.get("part", "full"))


def test_wrong_parameter_shape(case):
    params = {**case[2], "gamma": torch.ones(5, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"params\['gamma'\]: expected shape \(d,\) = \(4,\).*got shape \(5,\)"):
        call(case, params=params)


def test_wrong_rank_of_X(case):
    with pytest.raises(ValueError, match=r"X: expected shape \(B, L, d\) or \(L, d\), got shape \(2, 3, 4, 1\)"):
        call(case, "forward", X=case[3][..., None])


def test_wrong_target_shape(case):
    with pytest.raises(ValueError, match=r"target: expected shape \(B, L, d\) = \(2, 3, 4\), got shape \(2, 4, 3\)"):
        call(case, target=case[4].transpose(1, 2).contiguous())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["X", "target", "gamma"])
def test_non_finite_values(case, bad, where):
    module, backend, params, X, target = case
    changes = {}
    if where == "gamma":
        gamma = params["gamma"].clone()
        gamma[1] = bad
        changes["params"] = {**params, "gamma": gamma}
        argument = r"params\['gamma'\]"
    else:
        value = (X if where == "X" else target).clone()
        value[0, 1, 2] = bad
        changes[where] = value
        argument = where
    with pytest.raises(ValueError, match=argument + ": expected finite values, got NaN or inf"):
        call(case, **changes)


def test_finite_values_whose_sum_overflows_are_accepted(case):
    """The finite check may sum an input first; a sum that overflows must not be taken
    for a non-finite entry."""
    target = case[4].clone()
    target[0, 0, :2] = 1e308
    assert not math.isfinite(float(target.sum()))
    with np.errstate(over="ignore", invalid="ignore"):  # the loss overflows: not the point
        call(case, target=target)  # no ValueError


def test_unknown_wrt(case):
    with pytest.raises(ValueError, match=r"wrt: expected 'X' or one of the parameters \['gamma', 'beta'\], got 'W_Q'"):
        call(case, "jacobian", wrt="W_Q")
    with pytest.raises(ValueError, match=r"wrt: expected 'X' alone"):
        call(case, wrt=["X", "gamma"])


def test_unknown_part(case):
    with pytest.raises(ValueError, match=r"part: expected 'full', 'gauss_newton' or 'functional', got 'gn'"):
        call(case, part="gn")


def test_missing_and_unknown_params(case):
    with pytest.raises(ValueError, match=r"params: expected exactly the keys \['gamma', 'beta'\], got unknown \['delta'\] and missing \['beta'\]"):
        call(case, params={"gamma": case[2]["gamma"], "delta": case[2]["beta"]})


def test_integer_input_is_a_type_error(case):
    with pytest.raises(TypeError, match="X: expected a floating-point"):
        call(case, "forward", X=torch.ones(2, 3, 4, dtype=torch.int64))


def test_zero_variance_row_with_eps_zero(backend):
    module = generated_module("layernorm", backend)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    X[1, 2] = 0.7  # a constant row
    with pytest.raises(ValueError, match=r"X: LayerNorm needs every row variance > 0 \(the paper's "
                                         r"assumption min σ² > 0.*set eps > 0.*sample 1, row 2"):
        module.forward({}, to_backend(backend, X))


def test_zero_input_is_fine_with_eps(backend):
    module = generated_module("layernorm_affine", backend)
    params, X, _ = random_case(module, {"L": 3, "d": 4}, batch=2)
    out = module.forward(to_backend(backend, params), to_backend(backend, torch.zeros_like(X)))
    assert float(abs(out - to_backend(backend, params["beta"])).max()) == 0.0


def test_single_sample_drops_the_batch_axis(case):
    module, backend, params, X, target = case
    P = to_backend(backend, params)
    assert tuple(module.forward(P, to_backend(backend, X[0])).shape) == (3, 4)
    assert tuple(module.jacobian(P, to_backend(backend, X[0]), "gamma").shape) == (12, 4)
    batch = module.jacobian(P, to_backend(backend, X), "gamma")
    single = module.jacobian(P, to_backend(backend, X[1]), "gamma")
    assert float(abs(batch[1] - single).max()) == 0.0


def test_attention_weights_that_do_not_chain(backend):
    module = generated_module("self_attention", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4, "d_k": 2}, batch=2)
    params["W_K"] = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"params\['W_K'\]: expected shape \(d, d_k\) = \(4, 2\) to match the other inputs, got shape \(4, 3\)"):
        module.forward(to_backend(backend, params), to_backend(backend, X))


@pytest.fixture
def block_case(backend):
    module = generated_module("paper_block", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "p": 6, "c": 7}, batch=2)
    return module, backend, params, X, target


def test_ffn_weights_that_do_not_chain(block_case):
    module, backend, params, X, target = block_case
    params["W_2"] = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"params\['W_2'\]: expected shape \(d_ff, d\) = \(5, 4\) to match the other inputs, got shape \(6, 4\)"):
        module.loss(to_backend(backend, params), to_backend(backend, X), to_backend(backend, target))


def test_block_zero_input_breaks_the_papers_variance_assumption(block_case):
    """X = 0 makes X + F(X) = 0: LayerNorm_1 sees rows of zero variance (eps = 0)."""
    module, backend, params, X, target = block_case
    with pytest.raises(ValueError, match=r"X: LayerNorm_1 needs every row variance > 0 \(the paper's assumption min σ² > 0, here with eps = 0\).*set eps > 0.*sample 0, row 0"):
        module.hvp(to_backend(backend, params), to_backend(backend, torch.zeros_like(X)),
                   to_backend(backend, target), to_backend(backend, torch.ones(sum(
                       v.numel() for v in params.values()), dtype=torch.float64)))


def test_block_with_eps_accepts_zero_input(backend):
    module = generated_module("paper_block_eps", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "p": 6, "c": 7}, batch=2)
    H = module.loss_hessian(to_backend(backend, params), to_backend(backend, torch.zeros_like(X)),
                            to_backend(backend, target), wrt=["W_1", "W_2"])
    assert H.shape == (40, 40)


def test_block_target_of_wrong_shape(block_case):
    module, backend, params, X, target = block_case
    with pytest.raises(ValueError, match=r"target: expected shape \(B, L, d\) = \(2, 3, 4\), got shape \(2, 3\)"):
        module.loss(to_backend(backend, params), to_backend(backend, X),
                    to_backend(backend, target[..., 0]))


def test_block_unknown_wrt_lists_the_parameters(block_case):
    module, backend, params, X, target = block_case
    with pytest.raises(ValueError, match=r"wrt: expected 'X' or one of the parameters \['W_Q', 'W_K', 'W_V', 'W_1', 'W_2'\], got 'gamma_1'"):
        module.jacobian(to_backend(backend, params), to_backend(backend, X), "gamma_1")


@pytest.mark.parametrize("function", ["forward", "jacobian", "loss_hessian"])
def test_a_result_that_overflows_raises(block_case, function):
    """Finite inputs whose arithmetic overflows give an error naming the function, the
    quantity and the largest input, never an array of inf or NaN."""
    module, backend, params, X, target = block_case
    P, Xb, Tb = (to_backend(backend, v) for v in (params, X * 1e200, target))
    quantity = {"forward": "the output", "jacobian": "the Jacobian in W_K",
                "loss_hessian": r"the full loss Hessian in \['W_Q', 'W_K', 'W_V', 'W_1', 'W_2'\]"}
    with pytest.raises(FloatingPointError, match=(
            rf"{function}: {quantity[function]} has entries that are inf or NaN although every "
            r"input is finite: the arithmetic overflowed float64 \(largest \|entry\|: X [0-9.]+e\+200, "
            r"W_Q .*\); pass inputs and parameters of smaller magnitude")), \
            np.errstate(all="ignore"):
        if function == "forward":
            module.forward(P, Xb)
        elif function == "jacobian":
            module.jacobian(P, Xb, "W_K")
        else:
            module.loss_hessian(P, Xb, Tb)


def test_float32_overflow_suggests_float64(block_case):
    module, backend, params, X, target = block_case
    P, Xb = to_backend(backend, {k: v.float() for k, v in params.items()}), to_backend(
        backend, (X * 1e25).float())
    with pytest.raises(FloatingPointError, match=r"overflowed float32 .*; pass float64 inputs, or"), \
            np.errstate(all="ignore"):
        module.jacobian(P, Xb, "W_K")


HALF = {"numpy": [np.float16], "torch": [torch.float16, torch.bfloat16]}


def test_half_precision_is_computed_in_float32(block_case):
    """float16 (and bfloat16) inputs are computed in float32 and returned in their dtype."""
    module, backend, params, X, target = block_case
    for half in HALF[backend]:
        def cast(value, dtype, half=half):
            if backend == "numpy":
                return value.numpy().astype(half).astype(dtype)
            return value.to(half).to(dtype)
        wide = torch.float32 if backend == "torch" else np.float32
        inputs = {dtype: ({k: cast(v, dtype) for k, v in params.items()}, cast(X, dtype),
                          cast(target, dtype)) for dtype in (half, wide)}
        for function in ("forward", "loss_hessian", "hvp"):
            results = {}
            for dtype, (P, Xb, Tb) in inputs.items():
                if function == "forward":
                    results[dtype] = module.forward(P, Xb)
                elif function == "loss_hessian":
                    results[dtype] = module.loss_hessian(P, Xb, Tb, wrt=["W_V", "W_1"])
                else:
                    n = sum(int(np.prod(v.shape)) for v in P.values())
                    v = cast(torch.linspace(-1, 1, n, dtype=torch.float64), dtype)
                    results[dtype] = module.hvp(P, Xb, Tb, v)
            assert results[half].dtype == half
            expected = (results[wide].astype(half) if backend == "numpy"
                        else results[wide].to(half))
            assert (results[half] == expected).all(), (function, half)


def test_a_one_shot_iterator_is_refused_where_several_passes_are_needed():
    """``hessian_operator`` keeps the batches and passes over them at every product (as
    ``eigsh`` asks for many): a generator would be spent after the first."""
    import curvgap

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.LayerNorm(4, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.add_(torch.randn(4, generator=gen, dtype=torch.float64))
    c = curvgap.curvature(layer)
    X = torch.randn(6, 3, 4, generator=gen, dtype=torch.float64)
    T = torch.randn(6, 3, 4, generator=gen, dtype=torch.float64)
    batches = [(X[i:i + 2], T[i:i + 2]) for i in range(0, 6, 2)]
    for one_shot, kind in (((b for b in batches), "generator"), (iter(batches), "list_iterator"),
                           (map(tuple, batches), "map")):
        with pytest.raises(ValueError, match=rf"X: expected batches that can be iterated several "
                                             rf"times \(a DataLoader, or a list of \(X, T\)\), got "
                                             rf"a {kind}, which can be iterated once: "
                                             rf"hessian_operator passes over the dataset at every "
                                             rf"product; pass list\(\.\.\.\) of it, or a DataLoader"):
            c.hessian_operator(one_shot)
    v = torch.randn(8, generator=gen, dtype=torch.float64)
    expected = c.hvp(X, T, v)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, T), batch_size=2)
    for reusable in (batches, loader):
        operator = c.hessian_operator(reusable)
        for _ in range(3):  # a pass at every product
            assert torch.allclose(operator @ v, expected, rtol=1e-12, atol=1e-14)
    # one pass over a generator is fine where one is all that is made
    assert torch.allclose(c.hvp((b for b in batches), v), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("function", ["hvp", "gnvp"])
def test_a_direction_over_wrt_in_any_order_is_read_in_that_order(backend, function):
    """``v`` holds the ``wrt`` blocks in the order given, as the result does (it was split in
    ``PARAMS`` order while the result followed ``wrt``: the blocks came back swapped)."""
    module = generated_module("layernorm_affine", backend)
    params, X, target = random_case(module, {"L": 3, "d": 4}, batch=2)
    params, X, target = (to_backend(backend, a) for a in (params, X, target))
    names = [name for name, _ in module.PARAMS]
    assert len(names) == 2
    sizes = [int(np.prod(params[name].shape)) for name in names]
    v = np.random.default_rng(0).standard_normal(sum(sizes))
    v = to_backend(backend, torch.from_numpy(v))
    ordered = getattr(module, function)(params, X, target, v, wrt=names)
    swapped = v[sizes[0]:], v[:sizes[0]]
    cat = torch.cat if backend == "torch" else np.concatenate
    reversed_ = getattr(module, function)(params, X, target, cat(swapped), wrt=names[::-1])
    expected = cat([ordered[sizes[0]:], ordered[:sizes[0]]])
    assert float(abs(reversed_ - expected).max()) <= 1e-12 * float(abs(ordered).max())
