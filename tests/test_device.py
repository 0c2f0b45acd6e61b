"""curvgap computes on its inputs' device, whatever torch's default device is.

No GPU is needed to check this: with torch's default device set to ``meta`` (shapes, no
values), every tensor made without naming a device lands there, and the first operation that
mixes it with the inputs' (CPU) tensors, or reads its value, fails. A route that follows its
inputs' device gives the same bits with that default as without; one that does not fails the
same way on a GPU, where its tensors would be on the CPU beside CUDA inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import generated_module
from families import FAMILIES

import curvgap

#: Families of the default run; the slow run adds one of each other front end.
QUICK = ("GPT2Model attention_mask", "LlamaDecoderLayer")
SLOW = ("TransformerEncoder mask", "BertModel attention_mask", "GPT2LMHeadModel input_ids",
        "T5Block decoder", "FalconDecoderLayer parallel", "timm VisionTransformer")


def _routes(c, case, v: torch.Tensor) -> dict:
    """Every route of ``c`` on ``case``, as zero-argument callables."""
    X, T, kw = case.X, case.T, case.inputs
    name = [n for n, _ in case.module.named_parameters()][-1]  # untied in every family
    routes = {
        "forward": lambda: c.forward(X, **kw),
        "loss": lambda: c.loss(X, T, **kw),
        "gradient": lambda: c.gradient(X, T, **kw),
        "hvp": lambda: c.hvp(X, T, v, **kw),
        "gnvp": lambda: c.gnvp(X, T, v[:, 0], **kw),
        "operator": lambda: c.hessian_operator(X, T, **kw) @ v[:, 0],
        "loss_hessian": lambda: c.loss_hessian(X, T, wrt=name, **kw),
        "jacobian": lambda: c.jacobian(X, name, **kw),
        "diagonal": lambda: c.diagonal(X, T, wrt=name, **kw),
    }
    if X is not None and X.is_floating_point() and not kw:
        # a list of batches: a DataLoader's own sampler draws on the default device
        batches = [(X[:1], T[:1]), (X[1:], T[1:])]
        routes["hvp over batches"] = lambda: c.hvp(batches, v)
    return routes


def _assert_same(got: dict, expected: dict) -> None:
    """Each result of ``got`` on the device of, and bitwise equal to, ``expected``'s."""
    for name, value in got.items():
        assert value.device == expected[name].device, name
        assert torch.equal(value, expected[name]), name


def _case_and_direction(name: str):
    case = FAMILIES[name]()
    params = list(case.module.parameters())
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(sum(p.numel() for p in params), 2, generator=generator,
                    dtype=params[0].dtype)
    return case, v


@pytest.mark.parametrize("name", [*QUICK, *(pytest.param(n, marks=pytest.mark.slow)
                                            for n in SLOW)])
def test_every_route_follows_its_inputs_device(name):
    case, v = _case_and_direction(name)
    expected = {route: f() for route, f in _routes(curvgap.curvature(case.module, case.loss),
                                                   case, v).items()}
    with torch.device("meta"):  # a fresh object: reading the module happens here too
        routes = _routes(curvgap.curvature(case.module, case.loss), case, v)
        got = {route: f() for route, f in routes.items()}
    _assert_same(got, expected)


@pytest.mark.slow
def test_the_fused_route_follows_its_inputs_device():
    case, v = _case_and_direction("GPT2Block")
    c = curvgap.curvature(case.module, case.loss, fused=True)
    expected = c.hvp(case.X, case.T, v, **case.inputs)  # compiled here, for these sizes
    with torch.device("meta"):
        got = curvgap.curvature(case.module, case.loss, fused=True).hvp(case.X, case.T, v,
                                                                      **case.inputs)
    assert got.device == expected.device
    assert torch.equal(got, expected)


def test_a_generated_module_follows_its_inputs_device():
    module = generated_module("paper_block", "torch")  # size-generic: any sizes do
    generator = torch.Generator().manual_seed(0)
    sizes = {"L": 5, "d": 4, "d_k": 3, "d_ff": 7}
    params = {name: torch.randn(tuple(sizes[s] for s in shape), generator=generator,
                                dtype=torch.float64)
              for name, shape in module.PARAMS}
    X = torch.randn(2, sizes["L"], sizes["d"], generator=generator, dtype=torch.float64)
    T = torch.randn(2, sizes["L"], sizes["d"], generator=generator, dtype=torch.float64)
    n = sum(p.numel() for p in params.values())
    v = torch.randn(n, generator=generator, dtype=torch.float64)
    v_X = torch.randn(2, X[0].numel(), generator=generator, dtype=torch.float64)
    calls = {
        "forward": lambda: module.forward(params, X),
        "loss": lambda: module.loss(params, X, T),
        "jacobian": lambda: module.jacobian(params, X, "W_Q"),
        "output_hessian": lambda: module.output_hessian(params, X, "W_Q", "W_K"),
        "loss_hessian": lambda: module.loss_hessian(params, X, T, part="functional"),
        "hvp": lambda: module.hvp(params, X, T, v),
        "hvp in X": lambda: module.hvp(params, X, T, v_X, wrt="X"),
    }
    expected = {name: f() for name, f in calls.items()}
    with torch.device("meta"):
        got = {name: f() for name, f in calls.items()}
    _assert_same(got, expected)
