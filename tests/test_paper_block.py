"""The paper's Theorems 4-5 on the engine's named objects: every object is evaluated
directly from its index form, assembled with explicit Kronecker products at a tiny size,
and compared with the generated module's Jacobians and output Hessians."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from conftest import commutation

from curvgap.codegen.verify import random_case
from curvgap.derivations import sizes
from curvgap.derivations.config import load
from curvgap.derivations.evaluate import evaluate
from curvgap.derivations.paper import BlockObjects
from curvgap.derivations.sizes import B
from curvgap.generated.numpy import paper_block

DIMS = {"L": 2, "d": 3, "d_k": 2, "d_ff": 4}
SHAPES = {"Q": (3, 2), "K": (3, 2), "V": (3, 3), "1": (3, 4), "2": (4, 3)}
N = {k: int(np.prod(shape)) for k, shape in SHAPES.items()}           # n_i, entries of W_i


@pytest.fixture(scope="module")
def objects():
    return BlockObjects(load("configs/paper_block.toml"))


@pytest.fixture(scope="module")
def case():
    params, X, target = random_case(paper_block, DIMS, batch=1, seed=5)
    return {k: v.numpy() for k, v in params.items()}, X.numpy()


def numeric(objects, case, *names):
    """The named objects as dense arrays in the paper's layout."""
    params, X = case
    found = [objects.get(name) for name in names]
    values = {"X": X[0], **params}
    dims = {sizes.L: 2, sizes.d: 3, sizes.d_k: 2, sizes.d_ff: 4, B: 1}
    evaluate(objects.graph, objects.graph.assigns, values, dims)
    from curvgap.derivations.evaluate import evaluate_expr
    out = []
    for obj in found:
        array = evaluate_expr(objects.graph, obj.expr, values, dims)
        out.append(array.reshape(int(obj.rows.subs(dims)), int(obj.cols.subs(dims))))
    return out


def test_shapes_are_the_papers(objects):
    L, d, d_k, d_ff = sizes.L, sizes.d, sizes.d_k, sizes.d_ff
    assert (objects.get("J_Z").rows, objects.get("J_Z").cols) == (L * d, L * d)
    assert (objects.get("H_Z").rows, objects.get("H_Z").cols) == (L**2 * d**2, L * d)
    assert (objects.get("B_1").rows, objects.get("B_1").cols) == (L * d, d * d_ff)
    assert (objects.get("xi_1Q").rows, objects.get("xi_1Q").cols) == (L * d**2 * d_ff, d * d_k)
    with pytest.raises(ValueError, match="name: expected J_Z"):
        objects.get("G_1")


@pytest.mark.parametrize("i", ["Q", "V", "1", "2"])
def test_theorem_4_jacobian_is_J_Z_times_B(objects, case, i):
    J_Z, B_i = numeric(objects, case, "J_Z", f"B_{i}")
    params, X = case
    generated = paper_block.jacobian(params, X, f"W_{i}")[0]
    assert np.abs(J_Z @ B_i - generated).max() < 1e-12 * np.abs(generated).max()


@pytest.mark.parametrize("k", ["Q", "K", "V"])
def test_B_k_is_J_SY_J_Y_G_k(objects, case, k):
    J_SY, J_Y, G_k, B_k = numeric(objects, case, "J_SY", "J_Y", f"G_{k}", f"B_{k}")
    assert np.abs(J_SY @ J_Y @ G_k - B_k).max() < 1e-12 * np.abs(B_k).max()


@pytest.mark.parametrize("i, j", [("Q", "Q"), ("Q", "K"), ("V", "1"), ("1", "2"), ("2", "2"),
                                  ("K", "V")])
def test_theorem_5_assembles_the_block_hessian(objects, case, i, j):
    """``H_tr_ij = (J_Z ⊗ I_{n_i}) xi_ij + (I_{L·d} ⊗ B_i^T) H_Z B_j`` (Theorem 5)."""
    J_Z, H_Z, B_i, B_j, xi = numeric(objects, case, "J_Z", "H_Z", f"B_{i}", f"B_{j}",
                                     f"xi_{i}{j}")
    n_i = int(np.prod(SHAPES[i]))
    assembled = np.kron(J_Z, np.eye(n_i)) @ xi + np.kron(np.eye(J_Z.shape[0]), B_i.T) @ H_Z @ B_j
    params, X = case
    generated = paper_block.output_hessian(params, X, f"W_{i}", f"W_{j}")[0]
    assert np.abs(assembled - generated).max() < 1e-11 * np.abs(generated).max()


def test_relu_pairs_have_zero_xi(objects, case):
    """``xi_11 = xi_22 = 0``: ReLU'' = 0 a.e., and B_2 is linear in W_2 (App. B.5)."""
    assert objects.get("xi_11").expr.is_zero or not numeric(objects, case, "xi_11")[0].any()
    assert objects.get("xi_22").expr.is_zero
    assert sp.simplify(objects.get("J_Z").rows - sizes.L * sizes.d) == 0



def ffn_pieces(case):
    params, X = case
    L, d, d_ff = DIMS["L"], DIMS["d"], DIMS["d_ff"]
    T = X[0] @ params["W_Q"] @ params["W_K"].T @ X[0].T / np.sqrt(DIMS["d_k"])
    A = np.exp(T - T.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    U = X[0] + A @ X[0] @ params["W_V"]
    Y = (U - U.mean(-1, keepdims=True)) / U.std(-1, keepdims=True)
    D_sigma = np.diag((Y @ params["W_1"] > 0).reshape(-1).astype(float))
    return params, Y, D_sigma, L, d, d_ff


def test_printed_B_1_B_2_and_J_SY(objects, case):
    params, Y, D_sigma, L, d, d_ff = ffn_pieces(case)
    W_1, W_2 = params["W_1"], params["W_2"]
    B_1, B_2, J_SY = numeric(objects, case, "B_1", "B_2", "J_SY")
    printed_B_1 = np.kron(np.eye(L), W_2.T) @ D_sigma @ np.kron(Y, np.eye(d_ff))
    printed_B_2 = np.kron(np.maximum(Y @ W_1, 0), np.eye(d))
    printed_J_SY = (np.kron(np.eye(L), W_2.T) @ D_sigma @ np.kron(np.eye(L), W_1.T)
                    + np.eye(L * d))
    for printed, mine in ((printed_B_1, B_1), (printed_B_2, B_2), (printed_J_SY, J_SY)):
        assert np.abs(printed - mine).max() < 1e-12 * np.abs(mine).max()


def test_printed_xi_12_is_the_papers_xi_21(objects, case):
    """App. B.5 prints ``xi_12 = (I_L⊗K_{d,d_ff}⊗I_d)(I_{L d_ff}⊗vec_r I_d)(D_σ(Y⊗I_{d_ff}))``
    and obtains it "by differentiating B_2 with respect to W_1": that is ∂B_2/∂W_1, the
    paper's own ``xi_21`` (``xi_ij = ∂B_i/∂W_j``); as printed, it matches the engine's
    ``xi_21`` and not ``xi_12`` (whose layout is ``(L·d·n_1) × n_2``)."""
    params, Y, D_sigma, L, d, d_ff = ffn_pieces(case)
    printed = (np.kron(np.kron(np.eye(L), commutation(d, d_ff)), np.eye(d))
               @ np.kron(np.eye(L * d_ff), np.eye(d).reshape(-1, 1))
               @ (D_sigma @ np.kron(Y, np.eye(d_ff))))
    xi_12, xi_21 = numeric(objects, case, "xi_12", "xi_21")
    assert np.abs(printed - xi_21).max() < 1e-12 * np.abs(xi_21).max()
    assert np.abs(printed - xi_12).max() > 0.1 * np.abs(xi_12).max()


def test_printed_xi_21_does_not_chain():
    """App. B.5 prints ``xi_21 = (I_L⊗W_2^T) D_σ (I_L⊗K_{d_ff,d}⊗I_{d_ff})(I_{L d}⊗vec_r I_{d_ff})``:
    ``D_σ`` has ``L·d_ff`` columns but the next factor ``L·d_ff·d·d_ff`` rows."""
    L, d, d_ff = DIMS["L"], DIMS["d"], DIMS["d_ff"]
    D_sigma_columns = L * d_ff
    next_rows = np.kron(np.kron(np.eye(L), commutation(d_ff, d)), np.eye(d_ff)).shape[0]
    assert D_sigma_columns != next_rows



@pytest.mark.parametrize("k", ["Q", "K", "V"])
def test_printed_xi_1k_needs_I_n1_not_I_nk(objects, case, k):
    """App. B.5 prints ``xi_1k = ((I_L⊗W_2ᵀ)D_σ ⊗ I_{n_k})(I_L⊗K_{d_ff,d}⊗I_{d_ff})
    (I_{Ld}⊗vec_r I_{d_ff})(J_Y G_k)``: the first factor has ``L d_ff n_k`` columns, the
    next ``L d d_ff²`` rows. The product rule on ``B_1 = (I_L⊗W_2ᵀ)D_σ(Y⊗I_{d_ff})`` puts
    ``I_{n_1}`` there (``n_1 = d d_ff``, the columns of ``Y⊗I_{d_ff}``); so corrected, it
    equals the engine's ``xi_1k``."""
    params, Y, D_sigma, L, d, d_ff = ffn_pieces(case)
    J_Y, G_k, xi = numeric(objects, case, "J_Y", f"G_{k}", f"xi_1{k}")
    front = np.kron(np.eye(L), params["W_2"].T) @ D_sigma
    rest = (np.kron(np.kron(np.eye(L), commutation(d_ff, d)), np.eye(d_ff))
            @ np.kron(np.eye(L * d), np.eye(d_ff).reshape(-1, 1)) @ (J_Y @ G_k))
    assert np.kron(front, np.eye(N[k])).shape[1] != rest.shape[0]
    corrected = np.kron(front, np.eye(N["1"])) @ rest
    assert np.abs(corrected - xi).max() < 1e-12 * np.abs(xi).max()


@pytest.mark.parametrize("k", ["Q", "K", "V"])
def test_printed_xi_2k_agrees(objects, case, k):
    """``xi_2k = (I_L⊗K_{d,d_ff}⊗I_d)(I_{L d_ff}⊗vec_r I_d)(D_σ(I_L⊗W_1ᵀ) J_Y G_k)``."""
    params, Y, D_sigma, L, d, d_ff = ffn_pieces(case)
    J_Y, G_k, xi = numeric(objects, case, "J_Y", f"G_{k}", f"xi_2{k}")
    printed = (np.kron(np.kron(np.eye(L), commutation(d, d_ff)), np.eye(d))
               @ np.kron(np.eye(L * d_ff), np.eye(d).reshape(-1, 1))
               @ (D_sigma @ np.kron(np.eye(L), params["W_1"].T) @ J_Y @ G_k))
    assert np.abs(printed - xi).max() < 1e-12 * np.abs(xi).max()


@pytest.mark.parametrize("k, m", [(k, m) for k in "QKV" for m in "QKV"])
def test_printed_xi_kl_agrees(objects, case, k, m):
    """``xi_kℓ = (J_SY⊗I_{n_k})[(I_{Ld}⊗G_kᵀ)(H_Y G_ℓ) + (J_Y⊗I_{n_k}) Φ_kℓ]`` with the
    engine's ``H_Y = ∂²Y/∂U²`` and ``Φ_kℓ = ∂²F/∂W_k∂W_ℓ``."""
    J_SY, J_Y, H_Y, G_k, G_m, Phi, xi = numeric(objects, case, "J_SY", "J_Y", "H_Y", f"G_{k}",
                                                f"G_{m}", f"Phi_{k}{m}", f"xi_{k}{m}")
    L_d = J_Y.shape[0]
    printed = np.kron(J_SY, np.eye(N[k])) @ (np.kron(np.eye(L_d), G_k.T) @ (H_Y @ G_m)
                                             + np.kron(J_Y, np.eye(N[k])) @ Phi)
    assert np.abs(printed - xi).max() < 1e-12 * np.abs(xi).max()


@pytest.mark.parametrize("i, j", [("Q", "K"), ("1", "2"), ("V", "Q"), ("1", "Q")])
def test_H_tr_is_symmetric_slice_by_slice_not_as_printed(case, i, j):
    """App. B.5 claims ``H_tr^(i,j) = H_tr^(j,i)`` a.e. The two are ``(L d n_i) × n_j`` and
    ``(L d n_j) × n_i``: what holds is that every output's ``n_i × n_j`` slice is the
    transpose of the other's; as matrices they differ even when ``n_i = n_j``."""
    params, X = case
    a = paper_block.output_hessian(params, X, f"W_{i}", f"W_{j}")[0]
    b = paper_block.output_hessian(params, X, f"W_{j}", f"W_{i}")[0]
    slices_a, slices_b = a.reshape(-1, N[i], N[j]), b.reshape(-1, N[j], N[i])
    assert np.abs(slices_a - slices_b.transpose(0, 2, 1)).max() < 1e-12 * np.abs(a).max()
    if N[i] == N[j]:
        assert np.abs(a - b).max() > 0.5 * np.abs(a).max()
    else:
        assert a.shape != b.shape


def test_R_tr_is_the_loss_gradient_without_its_2_over_L_d(case):
    """``R^tr_m = vec_r(Z − T)ᵀ ⊗ I_m`` (Sec. 4.2): the functional part of the loss Hessian
    (``ℓ = ‖Z − T‖_F²/(L d)``) is ``(2/(L d)) R^tr_{n_i} H_tr^(i,j)``, and
    ``‖R^tr‖ = ‖Z − T‖_F``; ``M_tr``'s term ``‖R^tr‖‖H_tr‖`` drops the ``2/(L d)``, so it
    overstates that term ``L d / 2`` times."""
    params, X = case
    target = np.random.default_rng(9).normal(size=X.shape)
    Z = paper_block.forward(params, X)[0]
    functional = paper_block.loss_hessian(params, X, target, part="functional")
    offsets = np.cumsum([0] + [params[name].size for name, _ in paper_block.PARAMS])
    at = {name: slice(offsets[n], offsets[n + 1]) for n, (name, _) in enumerate(paper_block.PARAMS)}
    L, d = DIMS["L"], DIMS["d"]
    for i, j in (("Q", "K"), ("1", "2"), ("V", "1"), ("2", "2")):
        R = np.kron((Z - target[0]).reshape(1, -1), np.eye(N[i]))
        H_tr = paper_block.output_hessian(params, X, f"W_{i}", f"W_{j}")[0]
        mine = functional[at[f"W_{i}"], at[f"W_{j}"]]
        assert np.abs(2 / (L * d) * R @ H_tr - mine).max() < 1e-12 * max(np.abs(mine).max(),
                                                                           1e-300)
        frobenius = np.linalg.norm(Z - target[0])
        assert abs(np.linalg.norm(R, 2) - frobenius) < 1e-12 * frobenius
