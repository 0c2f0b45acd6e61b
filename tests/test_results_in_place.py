"""Results written into the caller's arrays (``out=`` of ``vjp_saved``, ``hvp_saved`` and
``gnvp_saved``): the same values as without ``out``, in the caller's memory, made there by the
matrix product for every weight (no copy), nothing kept by the saved state, and bad arrays
refused by name. The values themselves are checked against autograd elsewhere (test_models,
test_model_config); here the reference is the same call without ``out``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SHIPPED, generated_module, to_backend

from curvgap.models import Chain

SIZES = {"L": 3, "d": 6, "d_k": 4, "d_ff": 5}


def _point(backend: str):
    """The generated rmsnorm block, its parameters, a batch of 2, a target and a direction."""
    module = generated_module("rmsnorm_block", backend)
    shapes = Chain.generate([("", SHIPPED["rmsnorm_block"])], backend).parameter_shapes(SIZES)
    generator = torch.Generator().manual_seed(11)
    params, v = ({name: torch.randn(shape, generator=generator, dtype=torch.float64)
                  for name, shape in shapes.items()} for _ in range(2))
    X, T, v_X = (torch.randn(2, SIZES["L"], SIZES["d"], generator=generator,
                             dtype=torch.float64) for _ in range(3))
    return module, *(to_backend(backend, value) for value in (params, X, T, v, v_X))


def _flat(backend: str, params: dict):
    """A flat array for every parameter, filled with NaN, and its slices by name."""
    sizes = {name: int(np.prod(value.shape)) for name, value in params.items()}
    flat = torch.full((sum(sizes.values()),), float("nan"), dtype=torch.float64)
    if backend == "numpy":
        flat = flat.numpy()
    slices, offset = {}, 0
    for name, size in sizes.items():
        slices[name], offset = flat[offset:offset + size], offset + size
    return flat, slices


def _address(array) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data


def _results(module, saved, route: str, T, out=None) -> dict:
    if route == "vjp":
        return module.vjp_saved(saved, T, out=out)[0]
    return getattr(module, f"{route}_saved")(saved, T, out=out)[0]


def _copied(values: dict) -> dict:
    return {name: torch.as_tensor(np.array(value) if isinstance(value, np.ndarray)
                                  else value.clone()) for name, value in values.items()}


@pytest.mark.parametrize("route", ["vjp", "hvp", "gnvp"])
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_results_land_in_the_callers_arrays(backend, route, monkeypatch):
    module, params, X, T, v, v_X = _point(backend)
    _, saved = module.forward_saved(params, X)
    module.jvp_saved(saved, v, v_X)
    alone = _copied(_results(module, saved, route, T))
    flat, slices = _flat(backend, params)
    written = set()

    def recording(ns, name, a, b):
        if name in ns.get("_out", {}):
            written.add(name)
        return matmul_into(ns, name, a, b)

    matmul_into = module._matmul_into
    monkeypatch.setattr(module, "_matmul_into", recording)
    into = _results(module, saved, route, T, out=slices)
    start, end = _address(flat), _address(flat) + flat.nbytes
    for name, value in into.items():
        assert torch.equal(torch.as_tensor(value), alone[name]), name
        assert start <= _address(value) < end, f"{name} is not in the caller's array"
        assert not any(value is kept for kept in saved.values()), name
    assert not np.isnan(np.asarray(torch.as_tensor(flat))).any()
    weights = {f"{route}_joint_{name}" if route != "vjp" else f"gradient_{name}"
               for name in params if name.startswith("W_")}
    assert weights <= written, "a weight's matrix product did not write into the caller's array"
    # the next call without out makes its own arrays, and leaves the caller's as they are
    before = torch.as_tensor(flat).clone()
    again = _results(module, saved, route, T)
    for name, value in again.items():
        assert not start <= _address(value) < end, name
        assert torch.equal(torch.as_tensor(value), alone[name]), name
    assert torch.equal(torch.as_tensor(flat), before)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_bad_arrays_for_results_are_refused_by_name(backend):
    module, params, X, T, _, _ = _point(backend)
    _, saved = module.forward_saved(params, X)
    flat, slices = _flat(backend, params)
    strided = flat[: 2 * slices["W_Q"].shape[0]][::2]
    narrow = slices["W_Q"].astype(np.float32) if backend == "numpy" else slices["W_Q"].float()
    cases = [({"X": slices["W_Q"]}, ValueError,
              r"out: expected arrays for the parameters .* got one for 'X'"),
             ({"W_Q": slices["W_K"][:-1]}, ValueError,
              r"out\['W_Q'\]: expected a contiguous array of \d+ entries"),
             ({"W_Q": strided}, ValueError,
              r"out\['W_Q'\]: expected a contiguous array .* not contiguous"),
             ({"W_Q": narrow}, TypeError, r"out\[.W_Q.\]: expected dtype (torch\.)?float64")]
    for out, error, message in cases:
        with pytest.raises(error, match=message):
            module.vjp_saved(saved, T, out=out)
    # a refused call leaves the saved state usable
    assert all(np.isfinite(np.asarray(torch.as_tensor(value))).all()
               for value in module.vjp_saved(saved, T)[0].values())
