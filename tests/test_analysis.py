"""The paper's analyses (``curvgap.analysis``): bounds against true norms on many random
instances, the scaling degrees derived from the index form against fitted exponents and
against Ormaniec et al.'s, and the norms the analyses rest on against independent routes.

A bound found below its true value is a finding: it is recorded in ``docs/ERRATA.md`` and
shown here as a strict expected failure.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp
import torch
from torch.func import jacrev

from curvgap.analysis import bounds, scaling, vit
from curvgap.analysis.spectra import (
    lanczos_spectral_norm,
    spectral_norm,
    symmetric_spectral_norm,
)
from curvgap.codegen.verify import random_case
from curvgap.derivations.functions import ScalarFn, activation, exp, power, x
from curvgap.generated.torch import layernorm, paper_block, self_attention
from curvgap.operators import hessian_operator

#: one worker runs this file: its module-scoped fixtures are computed once
pytestmark = pytest.mark.xdist_group("analysis")

#: The same instances as the full ``curvgap reproduce``, so that every violation its report
#: lists is shown here.
ATTENTION_SEEDS = range(600)
BLOCK_SEEDS = range(128)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small tensors: one intra-op thread is several times faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _collect(seeds, block: bool, evaluate) -> dict:
    found: dict[tuple[str, str], list] = {}
    for seed in seeds:
        instance = bounds.random_instance(seed, block)
        for check in evaluate(instance):
            found.setdefault((check.theorem, check.quantity), []).append((seed, check))
    return found


@pytest.fixture(scope="module")
def attention_checks():
    return _collect(ATTENTION_SEEDS, False,
                    lambda i: bounds.theorem1(i.params, i.X, i.target))


@pytest.fixture(scope="module")
def block_checks():
    return _collect(BLOCK_SEEDS, True, lambda i: bounds.theorem6(i.params, i.X, i.target)
                    + bounds.ingredients(i.params, i.X))


def _violations(found: dict, key: tuple[str, str]) -> list:
    checks = found[key]
    assert len(checks) >= 10, f"{key}: only {len(checks)} instances with a non-zero true value"
    return [(seed, c.bound, c.true) for seed, c in checks if not c.holds]


def _xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


STEP_1 = ("step 1 of the proof of Theorem 1 takes ||dA/dT|| <= 1/L, which holds for uniform "
          "attention only (docs/ERRATA.md)")
MAIN, APPENDIX = "Theorem 1 (main text)", "Theorem 1 (appendix)"
THEOREM_1_BLOCKS = ("V,V", "Q,Q", "K,K", "V,Q", "V,K", "Q,K")
THEOREM_1_VIOLATED = {(APPENDIX, f"H({b}) Gauss–Newton") for b in ("Q,Q", "K,K", "Q,K")}
THEOREM_1_BOUNDS = [
    (label, quantity)
    for label in (MAIN, APPENDIX)
    for block in THEOREM_1_BLOCKS
    for quantity in (f"H({block}) Gauss–Newton", f"H({block}) functional", f"H({block})")
    if quantity != "H(V,V) functional"] + [(label, quantity) for label in (MAIN, APPENDIX)
                                            for quantity in ("M ≥ ‖H‖",
                                                             "M ≥ ‖H‖, six blocks (ours)")]


@pytest.mark.parametrize("label, quantity", [
    pytest.param(*key, marks=_xfail(STEP_1)) if key in THEOREM_1_VIOLATED else key
    for key in THEOREM_1_BOUNDS])
def test_theorem_1_bound_holds_on_random_instances(attention_checks, label, quantity):
    assert not _violations(attention_checks, (label, quantity))


@pytest.mark.parametrize("quantity", [pytest.param(f"‖G_{k}‖", marks=_xfail(STEP_1))
                                      for k in "QK"] + ["‖G_V‖"])
def test_g_bounds_on_self_attention_instances(attention_checks, quantity):
    """App. B.6's ``‖G_k‖`` bounds on the self-attention instances, where Theorem 1's
    Gauss–Newton ``(Q,Q)`` and ``(K,K)`` bounds (their squares) fail."""
    assert not _violations(attention_checks, ("App. B.6 Gk_bounds", quantity))


PAIRS = ([("1", "1"), ("2", "2"), ("1", "2"), ("2", "1")]
         + [(i, k) for k in "QKV" for i in "12"] + [(k, m) for k in "QKV" for m in "QKV"])
THEOREM_6_BOUNDS = [(label, quantity)
                    for label in ("Theorem 6", "Theorem 6 (σ_min = row std)")
                    for quantity in [f"{h}({i},{j})" for i, j in PAIRS for h in ("H_tr", "H")]
                    + ["M_tr ≥ ‖H‖"]]


@pytest.mark.parametrize("label, quantity", THEOREM_6_BOUNDS)
def test_theorem_6_bound_holds_on_random_instances(block_checks, label, quantity):
    assert not _violations(block_checks, (label, quantity))


LOSS_FACTOR = ("the printed Phi bounds carry the loss factor 2/(L d_V) although Phi is the "
               "loss-free second derivative of F, and step 1's 1/L (docs/ERRATA.md)")
SIGMA_MIN = ("with sigma_min = min_i ||M_i|| as printed, 1/sigma_min is sqrt(d) times smaller "
             "than ||P|| = 1/min_i std_i (docs/ERRATA.md)")
XI_21 = ("the printed ||xi_21|| <= sqrt(d_ff) ||W_2||: xi_21 = dB_2/dW_1 does not depend on "
         "W_2, its norm scales with ||Y|| (docs/ERRATA.md)")
INGREDIENTS = [
    pytest.param("Theorem 1, step 1", "‖∂A/∂T‖ ≤ 1/L", marks=_xfail(STEP_1)),
    pytest.param("Theorem 1, step 2", "‖Z_1‖ ≤ ‖X‖³/L", marks=_xfail(STEP_1)),
    ("Theorem 1, step 3", "‖A‖ ≤ L"), ("Theorem 1, step 3", "‖A X‖ ≤ L ‖X‖"),
    ("Theorem 1, step 5", "‖∂²A/∂T²‖ ≤ 6"),
    ("App. B.6 FFN factors", "‖B_1‖ ≤ ‖W_2‖‖Y‖"),
    ("App. B.6 FFN factors", "‖J_SY‖ ≤ ‖W_2‖‖W_1‖ + 1"),
    ("App. B.6 FFN factors", "‖ξ_12‖ ≤ √d ‖Y‖"),
    pytest.param("App. B.6 FFN factors", "‖ξ_21‖ ≤ √d_ff ‖W_2‖", marks=_xfail(XI_21)),
    ("App. B.6 Gk_bounds", "‖G_Q‖"), ("App. B.6 Gk_bounds", "‖G_V‖"),
    pytest.param("App. B.6 Gk_bounds", "‖G_K‖", marks=_xfail(STEP_1)),
    *[("App. B.6 Φ bounds", f"‖Φ_{k}{m}‖") for k, m in ("QQ", "KK", "QK", "KQ")],
    *[pytest.param("App. B.6 Φ bounds", f"‖Φ_{k}{m}‖", marks=_xfail(LOSS_FACTOR))
      for k, m in ("VQ", "QV", "VK", "KV")],
    *[(bounds.LEMMA, f"‖{m}_{n}‖") for m, n in ("JY", "HY", "HZ")],
    pytest.param(bounds.LEMMA, "‖J_Z‖", marks=_xfail(SIGMA_MIN)),
    *[(f"{bounds.LEMMA} (σ_min = row std)", f"‖{m}_{n}‖") for m in "JH" for n in "YZ"],
    ("App. C Y, S proposition", "‖Y‖"), ("App. C Y, S proposition", "‖S‖")]


@pytest.mark.parametrize("label, quantity", INGREDIENTS)
def test_ingredient_bound_holds_on_random_instances(block_checks, label, quantity):
    assert not _violations(block_checks, (label, quantity))


#: The instances docs/ERRATA.md records: (block?, seed, bound, quantity).
DOCUMENTED = [
    pytest.param(False, 155, APPENDIX, "H(Q,Q) Gauss–Newton", marks=_xfail(STEP_1)),
    pytest.param(False, 244, APPENDIX, "H(K,K) Gauss–Newton", marks=_xfail(STEP_1)),
    pytest.param(False, 155, APPENDIX, "H(Q,K) Gauss–Newton", marks=_xfail(STEP_1)),
    pytest.param(True, 24, "Theorem 1, step 1", "‖∂A/∂T‖ ≤ 1/L", marks=_xfail(STEP_1)),
    pytest.param(True, 48, "Theorem 1, step 2", "‖Z_1‖ ≤ ‖X‖³/L", marks=_xfail(STEP_1)),
    pytest.param(True, 116, "App. B.6 FFN factors", "‖ξ_21‖ ≤ √d_ff ‖W_2‖",
                 marks=_xfail(XI_21)),
    pytest.param(True, 88, "App. B.6 Gk_bounds", "‖G_K‖", marks=_xfail(STEP_1)),
    pytest.param(True, 5, "App. B.6 Φ bounds", "‖Φ_VK‖", marks=_xfail(LOSS_FACTOR)),
    pytest.param(True, 113, bounds.LEMMA, "‖J_Z‖", marks=_xfail(SIGMA_MIN)),
]


@pytest.mark.parametrize("block, seed, label, quantity", DOCUMENTED)
def test_documented_instance(block, seed, label, quantity):
    instance = bounds.random_instance(seed, block)
    if block:
        checks = bounds.ingredients(instance.params, instance.X)
    else:
        checks = bounds.theorem1(instance.params, instance.X, instance.target)
    (check,) = [c for c in checks if (c.theorem, c.quantity) == (label, quantity)]
    assert check.holds, f"bound {check.bound:.6g} < true {check.true:.6g}"


def test_theorem_1_reads_the_v_v_norm_off_its_kronecker_factor():
    """The true ``‖H(V,V)‖`` of Theorem 1's checks comes from the block's ``d × d`` factor;
    it equals the dense block's norm."""
    i = bounds.random_instance(3, block=False)
    checks = {c.quantity: c.true for c in bounds.theorem1(i.params, i.X, i.target)
              if c.theorem == "Theorem 1 (appendix)"}
    rows = bounds.block_slices(self_attention, i.params)["W_V"]
    for part, quantity in (("gauss_newton", "H(V,V) Gauss–Newton"), ("full", "H(V,V)")):
        dense = self_attention.loss_hessian(i.params, i.X, i.target, part=part)[rows, rows]
        assert abs(checks[quantity] - spectral_norm(dense)) <= 1e-12 * spectral_norm(dense)


def test_main_text_theorem_1_is_the_appendix_one_loosened():
    """Reading check: main-text ``M`` dominates the appendix ``M`` (r ≤ min(L, d) and larger
    constants), block by block."""
    for seed in range(20):
        i = bounds.random_instance(seed, block=False)
        norms = {"X": spectral_norm(i.X), "T": spectral_norm(i.target),
                 **{k: spectral_norm(i.params[f"W_{k}"]) for k in "QKV"}}
        rank = min(i.dims["L"], i.dims["d"])
        args = (norms, i.dims["L"], i.dims["d"], i.dims["d_k"], rank)
        main = bounds.theorem1_block_bounds(*args, "main")
        appendix = bounds.theorem1_block_bounds(*args, "appendix")
        for key in main:
            assert main[key][0] >= appendix[key][0] and main[key][1] >= appendix[key][1]


# -- the true values the bounds are compared with --------------------------------------------
def test_lanczos_on_the_generated_hvp_matches_eigvalsh():
    dims = {"L": 4, "d": 5, "d_k": 3, "d_ff": 7}
    params, X, target = random_case(paper_block, dims, batch=3, seed=2)
    H = paper_block.loss_hessian(params, X, target)
    dense = symmetric_spectral_norm(H)
    lanczos = lanczos_spectral_norm(hessian_operator(paper_block, params, X, target).to_scipy())
    assert abs(lanczos - dense) <= 1e-9 * dense


def test_layernorm_jacobian_norm_is_one_over_the_smallest_row_std():
    """Per row, ``∂LN/∂u = (I − 11^T/d − y y^T/d)/std``, a projector over ``std``: the
    generated Jacobian's norm is ``1/min_i std_i``, the ``"std"`` reading of ``σ_min``."""
    gen = torch.Generator().manual_seed(0)
    U = torch.randn(6, 5, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 3, 6)[:, None]
    norm = spectral_norm(layernorm.jacobian({}, U, "X"))
    assert abs(norm * bounds.sigma_min(U, "std") - 1) < 1e-12
    assert abs(bounds.sigma_min(U, "printed") / bounds.sigma_min(U, "std") - math.sqrt(5)) < 1e-12


def test_softmax_jacobian_norm_against_autograd():
    instance = bounds.random_instance(24, block=True)
    params, X = instance.params, instance.X
    (check,) = [c for c in bounds.ingredients(params, X) if c.quantity == "‖∂A/∂T‖ ≤ 1/L"]
    T = X @ params["W_Q"] @ params["W_K"].T @ X.T / math.sqrt(params["W_Q"].shape[1])
    L = T.shape[0]
    J = jacrev(lambda t: torch.softmax(t, dim=-1))(T).reshape(L * L, L * L)
    assert abs(check.true - spectral_norm(J)) <= 1e-12 * spectral_norm(J)


# -- scaling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, k, expected", [
    (activation("relu"), 1, 1), (activation("relu").diff(), 1, 0), (activation("gelu"), 2, 2),
    (exp(), 2, 0), (power(-1, 0), 0, 0), (power(-1, 0), 3, -3),
    (power(sp.Rational(-1, 2), 0), 2, -1), (power(sp.Rational(-1, 2), 1e-5), 2, 0),
    (power(sp.Rational(-1, 2), 1e-5).diff(), -1, sp.Rational(3, 2)),
    (ScalarFn("square", x ** 2), sp.Rational(1, 2), 1),
])
def test_function_degree(fn, k, expected):
    assert scaling.function_degree(fn, sp.Integer(k) if isinstance(k, int) else k) == expected


@pytest.fixture(scope="module")
def degrees():
    return {name: scaling.block_degrees(name)
            for name in ("self_attention", "paper_block", "paper_block_eps")}


def test_self_attention_degrees_are_ormaniec_et_al(degrees):
    """Ormaniec et al.: ``V–V ∝ σ²`` (Gauss–Newton, the functional part zero), ``Q–Q ∝ σ⁶``
    (Gauss–Newton) and ``σ⁵`` (functional)."""
    sa = degrees["self_attention"]
    assert sa["W_V", "W_V", "gauss_newton"] == 2 and sa["W_V", "W_V", "functional"] is None
    assert sa["W_Q", "W_Q", "gauss_newton"] == 6 and sa["W_Q", "W_Q", "functional"] == 5


def test_layernorm_changes_the_degrees(degrees):
    """With ``eps = 0`` LayerNorm is scale invariant: ``V–V`` and the FFN blocks become
    order one, ``Q–Q`` drops to ``σ⁴``. With ``eps > 0`` and ``σ → 0`` it is linear: the
    attention degrees are self-attention's, and ``V–V`` gains a functional part ``∝ σ³``."""
    block, eps = degrees["paper_block"], degrees["paper_block_eps"]
    assert block["W_V", "W_V", "gauss_newton"] == 0 and block["W_1", "W_2", "functional"] == 0
    assert block["W_Q", "W_Q", "gauss_newton"] == 4 and block["W_Q", "W_Q", "functional"] == 4
    for key, degree in degrees["self_attention"].items():
        if degree is not None:
            assert eps[key] == degree, key
    assert eps["W_V", "W_V", "functional"] == 3 and eps["W_1", "W_1", "gauss_newton"] == 2


SCALING_RANGES = {"self_attention": (-5, -3), "paper_block": (-5, -3),
                  "paper_block_eps": (-10, -8)}


@pytest.mark.parametrize("name", sorted(SCALING_RANGES))
def test_fitted_exponents_match_the_derived_degrees(degrees, name):
    low, high = SCALING_RANGES[name]
    data = scaling.sweep(name, {"L": 4, "d": 5, "d_k": 2, "d_ff": 3}, np.logspace(low, high, 5),
                         seed=7)
    off = {}
    for key, degree in degrees[name].items():
        fitted = scaling.fitted_exponent(data.sigmas, data.norms[key])
        if degree is None or fitted is None:
            assert degree is None and fitted is None, key
        elif abs(fitted - float(degree)) > 0.15:
            off[key] = (degree, fitted)
    assert not off


# -- the ViT of the convergence experiment --------------------------------------------------
def test_vit_sample_hessian_operator_against_central_differences_of_the_gradient():
    data = vit.digits()
    params = vit.init_params(seed=3)
    patch, label = data.train_x[0], data.train_y[0]
    operator = vit.sample_hessian_operator(params, patch, label)
    v = torch.randn(operator.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def gradient(shift: float) -> torch.Tensor:
        moved, offset = dict(params), 0
        for name in vit.PARAMS:
            size = params[name].numel()
            moved[name] = (params[name] + shift * v[offset:offset + size]
                           .reshape(params[name].shape)).requires_grad_(True)
            offset += size
        loss = vit.sample_losses(moved, patch[None], label[None])[0]
        grads = torch.autograd.grad(loss, [moved[name] for name in vit.PARAMS])
        return torch.cat([g.reshape(-1) for g in grads])

    step = 1e-5
    difference = (gradient(step) - gradient(-step)) / (2 * step)
    hv = operator @ v
    # central differences: O(step²) truncation, O(1e-16/step) rounding; 1e-9 observed
    assert (hv - difference).abs().max() <= 1e-7 * difference.abs().max()
