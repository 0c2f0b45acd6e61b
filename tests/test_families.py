"""``curvgap.curvature`` on the layers and models users study (:mod:`families`), read from
their computation: forward, loss, gradient, Hessian-vector and Gauss–Newton-vector products,
the Hessian's diagonal and the loss Hessian against reverse-over-reverse autograd on the
module itself (MATH attention kernel; its float64 twin where the library computes in float32
inside, the module itself then within 1e-5), backed by finite differences of the gradient."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES
from reference import Reference, relative

import curvgap

#: The families of the default run; the slow run takes every one. (The two timm models: a
#: chain part whose output is a flattened grid of patches, ``n2*n2_2`` with no class token
#: after it, once raised KeyError binding its target in gradient, hvp, gnvp and diagonal.)
QUICK = ("TransformerEncoderLayer padding mask", "GPT2Model attention_mask",
         "LlamaDecoderLayer", "GPT2LMHeadModel input_ids",
         "timm ViT class_token=False global_pool=avg", "timm CaiT class attention")
#: Families whose Hessian diagonal is checked in the default run too (a tied weight's
#: among them; CaiT's class-attention part takes 40 s to generate its second derivatives).
QUICK_DIAGONAL = ("GPT2LMHeadModel input_ids", "timm ViT class_token=False global_pool=avg")
#: Families whose whole loss Hessian is checked in the default run too.
QUICK_HESSIAN = ("TransformerEncoderLayer padding mask",)


def _cases(names=None):
    return [pytest.param(name, marks=() if name in (names or QUICK) else pytest.mark.slow)
            for name in FAMILIES]


@pytest.mark.parametrize("name", _cases())
def test_agrees_with_autograd(name):
    case = FAMILIES[name]()
    c = curvgap.curvature(case.module, case.loss)
    ref = Reference(case.module, case.X, case.T, case.loss, twin=case.float32_inside,
                    **case.inputs)
    out = c.forward(case.X, **case.inputs)
    assert relative(out, ref.output().detach()) <= 1e-10
    if case.float32_inside:  # the module as it runs, float32 inside
        own = Reference(case.module, case.X, case.T, case.loss, **case.inputs)
        assert relative(out, own.output().detach()) <= 1e-5
        assert relative(c.gradient(case.X, case.T, **case.inputs), own.gradient()) <= 1e-5
    assert relative(c.loss(case.X, case.T, **case.inputs), ref.loss().detach()) <= 1e-10
    gradient = ref.gradient()
    assert relative(c.gradient(case.X, case.T, **case.inputs), gradient) <= 1e-10
    generator = torch.Generator().manual_seed(1)
    V = torch.randn(gradient.numel(), 2, generator=generator, dtype=gradient.dtype)
    products = c.hvp(case.X, case.T, V, **case.inputs)
    for k in range(2):
        reference = ref.hvp(V[:, k])
        assert relative(products[:, k], reference) <= 1e-10
        assert relative(products[:, k], ref.gradient_fd(V[:, k])) <= 1e-6
    assert relative(c.gnvp(case.X, case.T, V[:, 0], **case.inputs), ref.gnvp(V[:, 0])) <= 1e-10


@pytest.mark.parametrize("name", _cases(QUICK_DIAGONAL))
def test_diagonal_agrees_with_autograd(name):
    """The Hessian's diagonal against reverse over reverse (its rows batched), every
    parameter's: a weight tied to another (a language-model head and its embedding) included,
    with the blocks between the places it is read."""
    case = FAMILIES[name]()
    c = curvgap.curvature(case.module, case.loss)
    reference = Reference(case.module, case.X, case.T, case.loss, twin=case.float32_inside,
                          **case.inputs).diagonal()
    assert relative(c.diagonal(case.X, case.T, **case.inputs), reference) <= 1e-10


@pytest.mark.parametrize("name", _cases(QUICK_HESSIAN))
def test_loss_hessian_agrees_with_autograd(name):
    case = FAMILIES[name]()
    c = curvgap.curvature(case.module, case.loss)
    ref = Reference(case.module, case.X, case.T, case.loss, twin=case.float32_inside,
                    **case.inputs)
    H = ref.hessian()
    assert H.shape[0] <= 3000  # families small enough for every row by autograd
    assert relative(c.loss_hessian(case.X, case.T, **case.inputs), H) <= 1e-10
    # the reference of test_diagonal_agrees_with_autograd (rows batched): these rows' own
    assert relative(ref.diagonal(), torch.diagonal(H)) <= 1e-13


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TransformerEncoder mask", "BertForSequenceClassification input_ids"])
def test_fused_agrees_with_autograd(name):
    """``fused=True`` (the generated sweeps through ``torch.compile``): gradient, HVP and GN
    product against autograd, on a chain of two masked encoder layers and on a classifier
    whose head's HVP scales a matrix product in place (``add_(a @ b, alpha=c)``, which
    inductor's addmm pattern miscompiles: 0.75 relative error with it on)."""
    case = FAMILIES[name]()
    c = curvgap.curvature(case.module, case.loss, fused=True)
    ref = Reference(case.module, case.X, case.T, case.loss, **case.inputs)
    gradient = ref.gradient()
    assert relative(c.gradient(case.X, case.T, **case.inputs), gradient) <= 1e-10
    v = torch.randn(gradient.numel(), generator=torch.Generator().manual_seed(1),
                    dtype=gradient.dtype)
    assert relative(c.hvp(case.X, case.T, v, **case.inputs), ref.hvp(v)) <= 1e-10
    assert relative(c.gnvp(case.X, case.T, v, **case.inputs), ref.gnvp(v)) <= 1e-10
    runner = c._traced[next(iter(c._traced))].runner()
    assert all("fused" in module.__name__ for module in runner.modules)
