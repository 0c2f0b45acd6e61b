"""The exact Hessian trace (``hessian_trace``), summed from the exact diagonal, for a
generated module (both backends) and a real module: the trace of reverse-over-reverse
autograd's Hessian (float64), over every parameter, one parameter, and the input per
sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SHIPPED, generated_module, to_backend
from families import encoder_layer
from reference import Reference, relative
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvgap
from curvgap.codegen.verify import random_case, reference_loss, reference_output


def _autograd_hessian(config, params, names, X, T) -> torch.Tensor:
    """The loss Hessian over ``names`` (in order) of the plain-PyTorch reference."""
    sizes = [params[n].numel() for n in names]

    def loss(flat):
        values = dict(params)
        values.update({n: p.reshape(params[n].shape)
                       for n, p in zip(names, torch.split(flat, sizes))})
        return sum(reference_loss(config, reference_output(config, values, x), t)
                   for x, t in zip(X, T)) / X.shape[0]

    flat = torch.cat([params[n].reshape(-1) for n in names])
    return torch.autograd.functional.hessian(loss, flat)


def test_a_generated_modules_trace_is_autograds(backend):
    config = SHIPPED["layernorm_affine"]
    module = generated_module("layernorm_affine", backend)
    params, X, T = random_case(module, {"L": 3, "d": 4}, batch=2)
    names = [name for name, _ in module.PARAMS]
    H = _autograd_hessian(config, params, names, X, T)
    args = [to_backend(backend, a) for a in (params, X, T)]
    for wrt, expected in ((None, H.trace()), ([names[1]], H[4:, 4:].trace())):
        got = torch.as_tensor(np.asarray(module.hessian_trace(*args, wrt=wrt)))
        assert got.ndim == 0 and relative(got, expected) <= 1e-10


def test_a_real_modules_trace_is_autograds():
    case = encoder_layer()
    c = curvgap.curvature(case.module)
    reference = Reference(case.module, case.X, case.T)
    assert relative(c.hessian_trace(case.X, case.T), reference.hessian().trace()) <= 1e-10
    per_sample = c.hessian_trace(case.X, case.T, wrt="X")
    with sdpa_kernel(SDPBackend.MATH):  # reverse over reverse through attention
        expected = torch.stack([torch.autograd.functional.hessian(
            lambda x, b=b: reference.loss_fn(case.module(x[None]), case.T[b:b + 1]),
            case.X[b]).reshape(case.X[b].numel(), -1).trace() for b in range(case.X.shape[0])])
    assert per_sample.shape == (case.X.shape[0],)
    assert relative(per_sample, expected) <= 1e-10


@pytest.mark.parametrize("part", ["gauss_newton", "functional"])
def test_the_trace_of_each_part_adds_to_the_whole(part):
    case = encoder_layer()
    c = curvgap.curvature(case.module)
    whole = c.hessian_trace(case.X, case.T)
    other = "functional" if part == "gauss_newton" else "gauss_newton"
    both = c.hessian_trace(case.X, case.T, part=part) + c.hessian_trace(case.X, case.T,
                                                                         part=other)
    assert relative(both, whole) <= 1e-12


def test_a_trace_past_its_dtypes_range_is_refused_not_inf():
    """Summed in float32 from a float16 diagonal: a trace past 65504 is an overflow error,
    not inf."""
    from curvgap.runtime.loading import checks

    diagonal = torch.full((10,), 3e4, dtype=torch.float16)
    with pytest.raises(FloatingPointError, match=r"hessian_trace: the trace was computed in "
                                                 r"float32 but exceeds the range of float16"):
        checks("torch")._trace_of(diagonal, "hessian_trace")
    assert checks("torch")._trace_of(diagonal[:2], "hessian_trace") == 6e4
