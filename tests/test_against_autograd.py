"""Generated modules against torch.func in float64: every function of the
contract, both backends, sizes with L != d and a batch of at least 2."""

from __future__ import annotations

import pytest
from conftest import SHIPPED, generated_module

from curvgap.codegen.generate import generate
from curvgap.codegen.verify import check_module

TOLERANCE = 1e-10
#: The second size runs with ``-m slow`` (CI); ``curvgap generate`` checks a third.
SIZES = [({"L": 3, "d": 4, "d_k": 5, "d_ff": 7, "p": 6, "c": 2}, 2),
         pytest.param({"L": 5, "d": 6, "d_k": 2, "d_ff": 3, "p": 4, "c": 7}, 3,
                      marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", sorted(SHIPPED))
@pytest.mark.parametrize("dims, batch", SIZES)
def test_shipped_module_matches_torch_func(name, backend, dims, batch):
    errors = check_module(SHIPPED[name], generated_module(name, backend), backend, dims,
                          batch, seed=batch)
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad}"
    assert len(errors) >= 8


def test_unshipped_variant_generated_in_a_temporary_folder(tmp_path, backend):
    """RMSNorm with affine gamma and eps: generated inside the test run, then checked."""
    import importlib.util

    config = tmp_path / "rms.toml"
    config.write_text('name = "rms_affine"\nkind = "layernorm"\nnorm = "rmsnorm"\n'
                      'eps = 1e-6\naffine = true\n')
    written = generate([config], tmp_path / "out", report=lambda line: None)
    path = next(p for p in written if p.parent.name == backend)
    spec = importlib.util.spec_from_file_location(f"rms_{backend}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [name for name, _ in module.PARAMS] == ["gamma"]
    from curvgap.derivations.config import load
    errors = check_module(load(config), module, backend, {"L": 4, "d": 3}, batch=2)
    assert max(errors.values()) <= TOLERANCE, errors


def test_verifier_measures_blocks_against_the_whole(backend):
    """Saturated attention (X × 10): the W_Q blocks are zero in exact arithmetic (here below
    1e-25 of the whole Jacobian); the verifier measures them against the whole Jacobian and
    output Hessian, so their rounding does not read as a failure."""
    from curvgap.codegen.verify import Reference, random_case

    config, module = SHIPPED["self_attention"], generated_module("self_attention", backend)
    dims = {"L": 3, "d": 4, "d_k": 5}
    errors = check_module(config, module, backend, dims, 2, input_scale=10.0)
    assert max(errors.values()) <= TOLERANCE, errors
    params, X, target = random_case(module, dims, 2)
    ref = Reference(config, module, params, X * 10.0, target)
    whole = max(float(ref.jacobian(v).abs().max()) for v in ("W_Q", "W_K", "W_V", "X"))
    assert 0 < float(ref.jacobian("W_Q").abs().max()) < 1e-25 * whole
