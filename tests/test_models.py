"""Stacks of blocks (``curvgap.models.Stack``): the loss, gradient and full loss Hessian of
a 3-layer stack, cross-layer blocks included, against reverse-over-reverse autograd on the
plain-PyTorch reference of the same stack (float64)."""

from __future__ import annotations

import pytest
import torch

from curvgap.codegen.verify import random_case, reference_loss, reference_output
from curvgap.derivations.config import validate
from curvgap.models import Stack

#: one worker runs this file: its module-scoped fixtures are computed once
pytestmark = pytest.mark.xdist_group("models")

DEPTH, B = 3, 2
DIMS = {"L": 3, "d": 4, "d_k": 2, "d_ff": 5}  # L, d, d_k, d_ff all differ
CONFIG = validate({"name": "stacked", "norm_position": "pre", "heads": 2, "out_proj": True,
                   "affine": True, "eps": 1e-5, "attention_bias": True, "activation": "gelu",
                   "ffn_bias": True})


@pytest.fixture(scope="module")
def case():
    stack = Stack(CONFIG, DEPTH)
    params = {}
    for k in range(DEPTH):
        layer, X, T = random_case(stack.top, DIMS, B, seed=k)
        params.update({f"{k}.{name}": value for name, value in layer.items()})
    flat = torch.cat([params[name].reshape(-1) for name in stack.PARAMS])
    return stack, params, X, T, flat


@pytest.fixture(scope="module")
def expected_hessian(case):
    stack, params, X, T, flat = case
    return torch.autograd.functional.hessian(reference(stack, params, X, T), flat)


def reference(stack, params, X, T):
    """The stack's loss as a function of all its parameters concatenated, in plain PyTorch."""
    sizes = [params[name].numel() for name in stack.PARAMS]

    def loss(flat):
        values = {name: part.reshape(params[name].shape) for name, part in
                  zip(stack.PARAMS, torch.split(flat, sizes))}
        total = 0.0
        for x, t in zip(X, T):
            for k in range(stack.depth):
                x = reference_output(CONFIG, {n: values[f"{k}.{n}"] for n in stack.block_params},
                                     x)
            total = total + reference_loss(CONFIG, x, t)
        return total / X.shape[0]

    return loss


def relative(value, expected) -> float:
    return float((value - expected).abs().max() / expected.abs().max())


def test_loss_and_gradient_equal_autograd(case):
    stack, params, X, T, flat = case
    loss = reference(stack, params, X, T)
    assert relative(stack.loss(params, X, T), loss(flat)) <= 1e-12
    expected = torch.autograd.functional.jacobian(loss, flat)
    assert relative(stack.gradient(params, X, T), expected) <= 1e-12


def test_full_hessian_with_cross_layer_blocks_equals_autograd(case, expected_hessian):
    stack, params, X, T, flat = case
    expected = expected_hessian
    H = stack.loss_hessian(params, X, T)
    assert H.shape == expected.shape
    assert relative(H, expected) <= 1e-10
    n = flat.numel() // DEPTH  # a cross-layer block (layers 0 and 2) on its own
    assert relative(H[:n, 2 * n:], expected[:n, 2 * n:]) <= 1e-10


def test_a_cross_layer_block_alone_equals_autograd(case, expected_hessian):
    stack, params, X, T, _ = case
    expected = expected_hessian
    wrt = ["0.W_V", "2.W_1", "2.b_2"]
    starts = {name: sum(params[n].numel() for n in stack.PARAMS[:stack.PARAMS.index(name)])
              for name in wrt}
    index = torch.cat([torch.arange(starts[n], starts[n] + params[n].numel()) for n in wrt])
    assert relative(stack.loss_hessian(params, X, T, wrt=wrt), expected[index][:, index]) <= 1e-10
    with pytest.raises(ValueError, match=r"wrt: expected 'X' or one of the parameters \['0.W_Q', "
                                         r".*\(48 in all\)\], got 'W_Q'$"):
        stack.loss_hessian(params, X, T, wrt="W_Q")


def test_one_layer_is_the_block(case):
    stack, params, X, T, _ = case
    one = Stack(CONFIG, 1)
    layer = {name: params[f"0.{name}"] for name in stack.block_params}
    assert torch.equal(one.loss_hessian({f"0.{n}": v for n, v in layer.items()}, X, T),
                       stack.top.loss_hessian(layer, X, T))


def test_bad_depth_and_params_are_refused(case):
    stack, params, X, T, _ = case
    with pytest.raises(ValueError, match="depth: expected an int >= 1, got 0"):
        Stack(CONFIG, 0)
    with pytest.raises(ValueError, match=r"params: expected exactly the keys .*, got unknown "
                                         r"\['3.W_Q'\] and missing \['2.W_Q'\]"):
        stack.gradient({**{k: v for k, v in params.items() if k != "2.W_Q"},
                        "3.W_Q": params["2.W_Q"]}, X, T)


def test_transformer_encoder_through_curvature_equals_autograd():
    """``curvgap.curvature`` on a 2-layer ``torch.nn.TransformerEncoder`` with its final
    norm: the full Hessian in the model's own parameter order, cross-layer blocks included,
    against reverse over reverse on the model (MATH attention kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import curvgap

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True,
                                             dtype=torch.float64)
    norm = torch.nn.LayerNorm(4, eps=1e-6, dtype=torch.float64)
    model = torch.nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.7 + (0.5 if p.ndim == 1 else 0.0))
    generator = torch.Generator().manual_seed(1)
    X, T = (torch.randn(B, 3, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    params = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):
        loss = torch.nn.functional.mse_loss(model(X), T)
        flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params,
                                                                     create_graph=True)])
        H = torch.stack([torch.cat([r.reshape(-1) for r in torch.autograd.grad(
            flat[k], params, retain_graph=True)]) for k in range(flat.numel())])
    c = curvgap.curvature(model)
    assert relative(c.loss(X, T), loss.detach()) <= 1e-12
    assert relative(c.gradient(X, T), flat.detach()) <= 1e-12
    assert relative(c.loss_hessian(X, T), H) <= 1e-10
    model.layers[1].activation = torch.nn.functional.relu  # the blocks differ now
    with sdpa_kernel(SDPBackend.MATH):
        loss = torch.nn.functional.mse_loss(model(X), T)
        flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
    assert relative(c.gradient(X, T), flat) <= 1e-12


def test_the_hessian_trace_is_the_trace_of_autograds_hessian(case, expected_hessian):
    """The trace from the exact diagonal (the Hessian never formed), over every parameter
    and over one layer's: the trace of autograd's full Hessian and of its block."""
    stack, params, X, T, flat = case
    expected = expected_hessian
    assert relative(stack.hessian_trace(params, X, T), expected.trace()) <= 1e-10
    n = flat.numel() // DEPTH
    wrt = [name for name in stack.PARAMS if name.startswith("1.")]
    assert relative(stack.hessian_trace(params, X, T, wrt=wrt),
                    expected[n:2 * n, n:2 * n].trace()) <= 1e-10
