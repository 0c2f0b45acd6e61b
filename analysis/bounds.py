"""The paper's spectral-norm bounds, evaluated from weights and inputs, against true norms.

Everything is per sample: one input ``X`` (``L×d``) and target (``L×d``), the per-sample
MSE ``ℓ = ‖Z − T‖_F² / (L·d)`` and its Hessian ``H_i = ∇²_w ℓ`` (the generated
``loss_hessian`` on a batch of one). Norms ``‖·‖`` are spectral unless named ``_F``.

* Theorem 1 (self-attention, ``w = {W_Q, W_K, W_V}``): per block ``(i, j)`` the proof's
  bounds on ``‖H_o(W_i, W_j)‖`` (Gauss–Newton) and ``‖H_f(W_i, W_j)‖`` (functional), their
  sum on the block, and ``M = 3 max_ij (…)`` on ``‖H_i‖``; main-text and appendix (App. B.1)
  versions.
* Theorem 6 (the post-LN block, ``w = {W_1, W_2, W_K, W_Q, W_V}``): the per-block bound on
  the output Hessian ``H_tr^(i,j) = ∂²Z/∂W_i∂W_j`` (``(L·d·n_i) × n_j``),
  ``‖J_Z‖‖ξ_ij‖ + ‖B_i‖‖H_Z‖‖B_j‖``, with every factor replaced by its bound from App. B.6,
  App. C; the per-block loss-Hessian bound
  ``(2/(L·d)) ‖∂Z/∂W_i‖‖∂Z/∂W_j‖ + ‖R^tr‖‖H_tr^(i,j)‖``; and ``M_tr = 5 max_ij (…)``.
* The ingredients those rest on (the steps of Theorem 1's proof, ``G_k``, ``Φ_kℓ``, the FFN
  factors, App. C's LayerNorm lemma on the LayerNorm Jacobian and Hessian, App. C's
  proposition on ``‖Y‖``, ``‖S‖``), each against its true value, so that a violated bound
  can be traced to the step that fails.

True values come from the generated torch modules (``self_attention``, ``layernorm``,
``paper_block``), which the test suite proves against ``torch.func``.

Readings of the printed formulas (stated in the report and in ``docs/ERRATA.md``):
``H(K,K)`` and ``H(V,K)`` are ``H(Q,Q)`` and ``H(V,Q)`` with ``W_Q ↔ W_K`` (the paper
lists four blocks); ``Φ_KK``, ``Φ_KQ``, ``Φ_QV``, ``Φ_KV`` likewise ("by symmetry");
``‖R^tr‖ = ‖vec_r(Z − T)^T ⊗ I‖ = ‖Z − T‖_F`` and, as printed, without the factor
``2/(L·d)`` of ``∂ℓ/∂Z``; ``‖Y‖`` and ``‖S‖`` by App. C's proposition; ``σ_min`` of App. C's
LayerNorm lemma either as printed, ``min_i ‖M_i‖₂`` (row norms of the centred input), or as the row
standard deviation ``min_i ‖M_i‖₂ / √n`` that its proof's ``‖P‖ = 1/σ_min`` uses.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..derivations import calculus, sizes
from ..derivations.evaluate import evaluate
from ..derivations.graph import Graph
from ..derivations.paper import WEIGHTS
from ..derivations.softmax import softmax_rows
from ..generated.torch import ffn, layernorm, paper_block, self_attention
from ..operators import kronecker_block
from .spectra import block_slices, hessian_norm, spectral_norm, symmetric_spectral_norm

#: The short names of the attention weights (WEIGHTS maps short names to parameters).
ATTENTION = ("Q", "K", "V")
SIGMA_MIN_READINGS = ("printed", "std")
#: The blocks whose bounds are the four arguments of Theorem 1's printed ``M``.
PRINTED_ARGUMENTS = (("V", "V"), ("Q", "Q"), ("V", "Q"), ("Q", "K"))
#: The label of App. C's lemma on the norms of the LayerNorm Jacobian and Hessian.
LEMMA = "App. C LayerNorm lemma"
#: What marks a bound as our repair of a printed one, in its theorem or quantity label.
REPAIR_MARKS = ("(σ_min = row std)", "(ours)")


def is_printed(theorem: str, quantity: str) -> bool:
    """Whether the bound is the paper's statement as printed, not one of our repairs."""
    return not any(mark in theorem or mark in quantity for mark in REPAIR_MARKS)


@dataclass(frozen=True)
class Check:
    """One bound against the true value it claims to bound."""

    theorem: str
    quantity: str
    bound: float
    true: float

    @property
    def ratio(self) -> float:
        """``bound / true`` (``true > 0``); below 1 the bound is violated."""
        return self.bound / self.true

    @property
    def holds(self) -> bool:
        return self.bound >= self.true


@dataclass
class Instance:
    """One random sample: parameters, input ``X`` (``L×d``), target, and how they were
    drawn."""

    params: dict[str, torch.Tensor]
    X: torch.Tensor
    target: torch.Tensor
    dims: dict[str, int]
    input_scale: float
    weight_scale: float
    seed: int


def random_instance(seed: int, block: bool) -> Instance:
    """A random per-sample case: sizes ``L ∈ 2..24, d ∈ 2..5, d_k ∈ 1..4, d_ff ∈ 2..6``
    (``d ≥ 3`` for the block: LayerNorm maps every row of width 2 to ``±(1, −1)``),
    ``X = s_x N(0, 1)`` and ``W = s_w N(0, 1)`` with ``s_x`` log-uniform on ``[0.3, 3]``
    and ``s_w`` on ``[0.2, 2]``, target ``N(0, 1)``; the block's parameters when
    ``block``, self-attention's otherwise."""
    rng = random.Random(seed)
    dims = {"L": rng.randint(2, 24), "d": rng.randint(3 if block else 2, 5),
            "d_k": rng.randint(1, 4), "d_ff": rng.randint(2, 6)}
    input_scale = math.exp(rng.uniform(math.log(0.3), math.log(3.0)))
    weight_scale = math.exp(rng.uniform(math.log(0.2), math.log(2.0)))
    module = paper_block if block else self_attention
    gen = torch.Generator().manual_seed(seed)
    params = {name: weight_scale * torch.randn(*(dims[s] for s in shape), generator=gen,
                                               dtype=torch.float64)
              for name, shape in module.PARAMS}
    X = input_scale * torch.randn(dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    target = torch.randn(dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    return Instance(params, X, target, dims, input_scale, weight_scale, seed)


def _nonzero(checks: list[Check]) -> list[Check]:
    """The checks whose true value is not zero (a zero norm meets every bound ``≥ 0``;
    saturated softmax rows or a width-2 LayerNorm make some blocks vanish exactly)."""
    return [c for c in checks if c.true > 0]


def _attention_params(params: dict) -> dict:
    return {name: params[name] for name in ("W_Q", "W_K", "W_V")}


# -- Theorem 1 -------------------------------------------------------------------------------
def theorem1_block_bounds(norms: dict[str, float], L: int, d: int, d_k: int, rank: int,
                          version: str) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(i, j): (bound on ‖H_o(W_i,W_j)‖, bound on ‖H_f(W_i,W_j)‖)}`` of Theorem 1,
    ``version`` ``"main"`` (Sec. 4.1, ``√min(L, d)``) or ``"appendix"`` (App. B.1, ``√r`` with
    ``r = rank(F(X) − T)``). ``norms`` holds ``‖X‖, ‖W_Q‖, ‖W_K‖, ‖W_V‖, ‖T‖`` under
    ``"X", "Q", "K", "V", "T"``."""
    x, nq, nk, nv = norms["X"], norms["Q"], norms["K"], norms["V"]
    c_t = L * x * nv + norms["T"]
    main = version == "main"
    root = math.sqrt(min(L, d)) if main else math.sqrt(rank)
    outer = (8 if main else 2) / (L ** 3 * d * d_k)

    def qq(w_k: float) -> tuple[float, float]:
        return (outer * w_k ** 2 * nv ** 2 * x ** 6,
                12 / (d * d_k) * root * c_t * nv * w_k ** 2 * x ** 5)

    def vq(w_k: float) -> tuple[float, float]:
        if main:
            return (4 / (L * d * math.sqrt(d_k)) * nv * w_k * x ** 4,
                    4 * root / (L ** 2 * math.sqrt(d_k)) * c_t * w_k * x ** 3)
        return (2 / (L * d * math.sqrt(d_k)) * nv * w_k * x ** 4,
                2 * root / (L ** 2 * math.sqrt(d * d_k)) * c_t * w_k * x ** 3)

    scale = (4 / (L * d * math.sqrt(d_k)) if main
             else 2 / (L * d * math.sqrt(d * d_k)))
    qk = (outer * nk * nq * nv ** 2 * x ** 6,
          scale * root * c_t * nv * (3 * L * nk * nq * x ** 5 + d / L * x ** 3))
    return {("V", "V"): (2 * L / d * x ** 2, 0.0), ("Q", "Q"): qq(nk), ("K", "K"): qq(nq),
            ("V", "Q"): vq(nk), ("V", "K"): vq(nq), ("Q", "K"): qk}


def theorem1(params: dict, X: torch.Tensor, target: torch.Tensor,
             per_block: bool = True) -> list[Check]:
    """Theorem 1 (both versions) for one sample: ``M`` against ``‖H_i‖₂``, as printed
    (``3 max`` of its four arguments, the blocks of :data:`PRINTED_ARGUMENTS`) and our
    repair (``3 max`` over all six blocks, ``(K,K)``, ``(V,K)`` by ``W_Q ↔ W_K``, which the
    proof's step 6 assembles over); with ``per_block``, also every block and part, App. B.6's
    ``‖G_k‖`` bounds (the Gauss–Newton ``(Q,Q)`` bound is ``(2/(L d))`` times the square of
    ``‖G_Q‖``'s), and ``‖H_i‖₂`` dense; without, ``‖H_i‖₂`` by
    :func:`.spectra.hessian_norm` (Lanczos on the generated ``hvp`` above its dense limit)."""
    L, d = X.shape
    d_k = params["W_Q"].shape[1]
    norms = {"X": spectral_norm(X), "Q": spectral_norm(params["W_Q"]),
             "K": spectral_norm(params["W_K"]), "V": spectral_norm(params["W_V"]),
             "T": spectral_norm(target)}
    rank = int(torch.linalg.matrix_rank(self_attention.forward(params, X) - target))
    versions = {label: theorem1_block_bounds(norms, L, d, d_k, rank, version)
                for version, label in (("main", "Theorem 1 (main text)"),
                                       ("appendix", "Theorem 1 (appendix)"))}
    if not per_block:
        full = hessian_norm(self_attention, params, X, target)
        return _nonzero([c for label, blocks in versions.items()
                         for c in _m_checks(label, blocks, full)])
    H = {part: self_attention.loss_hessian(params, X, target, part=part)
         for part in ("gauss_newton", "functional")}
    H["full"] = H["gauss_newton"] + H["functional"]
    slices = block_slices(self_attention, params)
    true = {part: {(a, b): spectral_norm(value[slices[f"W_{a}"], slices[f"W_{b}"]])
                   for a in ATTENTION for b in ATTENTION} for part, value in H.items()}
    # the V–V block is exactly A ⊗ I_d (the module's STRUCTURED): its norm from A, d × d
    for part in ("gauss_newton", "full"):
        factors = kronecker_block(self_attention, params, X, target, "W_V", part=part)
        true[part]["V", "V"] = float(factors.eigvalsh().abs().max())
    full = symmetric_spectral_norm(H["full"])
    # the Gauss–Newton bounds are (2/(L d)) times products of G_k bounds: those checked too
    checks = g_checks(params, X, attention_factor_bounds(norms, L, d, d_k)[0])
    for label, blocks in versions.items():
        for (a, b), (outer, functional) in blocks.items():
            name = f"H({a},{b})"
            checks.append(Check(label, f"{name} Gauss–Newton", outer,
                                true["gauss_newton"][a, b]))
            if functional > 0:
                checks.append(Check(label, f"{name} functional", functional,
                                    true["functional"][a, b]))
            checks.append(Check(label, name, outer + functional, true["full"][a, b]))
        checks += _m_checks(label, blocks, full)
    return _nonzero(checks)


def _m_checks(label: str, blocks: dict, full: float) -> list[Check]:
    """Theorem 1's ``M`` against ``‖H_i‖₂ = full``: as printed, ``3 max`` of the four
    arguments (:data:`PRINTED_ARGUMENTS`), and our repair, ``3 max`` over all six blocks."""
    return [Check(label, "M ≥ ‖H‖", 3 * max(sum(blocks[b]) for b in PRINTED_ARGUMENTS), full),
            Check(label, "M ≥ ‖H‖, six blocks (ours)",
                  3 * max(o + f for o, f in blocks.values()), full)]


# -- App. C: the LayerNorm lemma, the proposition on ‖Y‖, ‖S‖ -------------------------------
def sigma_min(U: torch.Tensor, reading: str) -> float:
    """``σ_min`` of App. C's LayerNorm lemma for the rows of ``U`` (``m×n``):
    ``min_i ‖M_i‖₂`` with ``M = U (I − 1 1^T / n)`` (``"printed"``) or ``min_i ‖M_i‖₂ / √n``,
    the smallest row standard deviation (``"std"``)."""
    centred = U - U.mean(-1, keepdim=True)
    rows = torch.linalg.vector_norm(centred, dim=-1).min()
    scale = 1.0 if reading == "printed" else math.sqrt(U.shape[-1])
    return float(rows) / scale


def layernorm_lemma(norm_u: float, s: float, m: int, n: int) -> tuple[float, float]:
    """App. C LayerNorm lemma at an input of spectral norm ``norm_u`` and ``σ_min = s`` (``m×n``):
    ``(‖J_LN‖ bound, ‖H_LN‖ bound)`` =
    ``(1/s + ‖U‖²/(√n s³), ‖U‖/s³ (1 + √(m/n)) + ‖U‖²/(√n s³) + 3‖U‖³/(n s⁵))``."""
    jac = 1 / s + norm_u ** 2 / (math.sqrt(n) * s ** 3)
    hess = (norm_u / s ** 3 * (1 + math.sqrt(m / n)) + norm_u ** 2 / (math.sqrt(n) * s ** 3)
            + 3 * norm_u ** 3 / (n * s ** 5))
    return jac, hess


@dataclass
class BlockForward:
    """The block's forward intermediates for one sample: ``F`` (attention), ``U = X + F``,
    ``Y = LN(U)``, ``P = ReLU(Y W_1)``, ``S = Y + P W_2``, ``Z = LN(S)``."""

    F: torch.Tensor
    U: torch.Tensor
    Y: torch.Tensor
    P: torch.Tensor
    S: torch.Tensor
    Z: torch.Tensor


def block_forward(params: dict, X: torch.Tensor) -> BlockForward:
    """The intermediates from the generated ``self_attention`` and ``layernorm``."""
    F = self_attention.forward(_attention_params(params), X)
    U = X + F
    Y = layernorm.forward({}, U)
    P = torch.relu(Y @ params["W_1"])
    S = Y + P @ params["W_2"]
    return BlockForward(F, U, Y, P, S, layernorm.forward({}, S))


# -- Theorem 6 -------------------------------------------------------------------------------
@dataclass
class BlockBounds:
    """Theorem 6's factor bounds and per-block bounds for one sample."""

    G: dict[str, float]
    Phi: dict[tuple[str, str], float]
    B: dict[str, float]
    xi: dict[tuple[str, str], float]
    H_tr: dict[tuple[str, str], float]
    loss: dict[tuple[str, str], float]
    J_Y: float
    H_Y: float
    J_Z: float
    H_Z: float

    @property
    def M_tr(self) -> float:
        """``M_tr = 5 max_ij (loss-Hessian block bound)``."""
        return 5 * max(self.loss.values())


def attention_factor_bounds(norms: dict[str, float], L: int, d: int, d_k: int
                            ) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """``(‖G_k‖ bounds, ‖Φ_kℓ‖ bounds)`` of App. B.6 (eq. ``Gk_bounds`` and the ``Φ`` list)."""
    x, nq, nk, nv = norms["X"], norms["Q"], norms["K"], norms["V"]
    G = {"V": L * x, "Q": nv * nk * x ** 3 / (L * math.sqrt(d_k)),
         "K": nv * nq * x ** 3 / (L * math.sqrt(d_k))}
    mixed = 2 / (L ** 2 * math.sqrt(d * d_k)) * x ** 3
    fifth = 12 / (L * d * d_k) * nv * x ** 5
    qk = fifth * nk * nq + mixed * nv
    Phi = {("V", "V"): 0.0, ("Q", "Q"): fifth * nk ** 2, ("K", "K"): fifth * nq ** 2,
           ("Q", "K"): qk, ("K", "Q"): qk, ("V", "Q"): mixed * nk, ("Q", "V"): mixed * nk,
           ("V", "K"): mixed * nq, ("K", "V"): mixed * nq}
    return G, Phi


def g_checks(attention: dict, X: torch.Tensor, G: dict[str, float]) -> list[Check]:
    """App. B.6's ``‖G_k‖`` bounds ``G`` against the true ``‖∂F/∂W_k‖`` (``G_k`` is the
    self-attention Jacobian, ``(L·d) × n_k``)."""
    return [Check("App. B.6 Gk_bounds", f"‖G_{k}‖", G[k],
                  spectral_norm(self_attention.jacobian(attention, X, WEIGHTS[k])))
            for k in ATTENTION]


def theorem6_bounds(params: dict, X: torch.Tensor, target: torch.Tensor,
                    reading: str) -> BlockBounds:
    """Every bound of Theorem 6 for one sample of ``paper_block``, ``σ_min`` read as
    ``reading`` (see :func:`sigma_min`)."""
    L, d = X.shape
    d_k, d_ff = params["W_Q"].shape[1], params["W_1"].shape[1]
    fwd = block_forward(params, X)
    norms = {"X": spectral_norm(X), **{k: spectral_norm(params[WEIGHTS[k]])
                                       for k in ("Q", "K", "V", "1", "2")}}
    n1, n2 = norms["1"], norms["2"]
    norm_y = math.sqrt(L * d)                                          # App. C Y, S proposition
    norm_s = norm_y * (1 + math.sqrt(min(L, d_ff)) * n1 * n2)          # App. C Y, S proposition
    J_Y, H_Y = layernorm_lemma(spectral_norm(fwd.U), sigma_min(fwd.U, reading), L, d)
    J_Z, H_Z = layernorm_lemma(norm_s, sigma_min(fwd.S, reading), L, d)
    G, Phi = attention_factor_bounds(norms, L, d, d_k)
    J_SY = n2 * n1 + 1
    B = {"1": n2 * norm_y, "2": spectral_norm(fwd.P), **{k: J_SY * J_Y * G[k] for k in G}}
    xi = {("1", "1"): 0.0, ("2", "2"): 0.0, ("1", "2"): math.sqrt(d) * norm_y,
          ("2", "1"): math.sqrt(d_ff) * n2}
    for k in ATTENTION:
        xi["1", k] = math.sqrt(d_ff) * n2 * J_Y * G[k]
        xi["2", k] = math.sqrt(d) * n1 * J_Y * G[k]
        for m in ATTENTION:
            xi[k, m] = J_SY * (G[k] * H_Y * G[m] + J_Y * Phi[k, m])
    H_tr = {(i, j): J_Z * value + B[i] * H_Z * B[j] for (i, j), value in xi.items()}
    residual = float(torch.linalg.matrix_norm(fwd.Z - target))      # ‖R^tr‖ = ‖Z − T‖_F
    loss = {(i, j): 2 / (L * d) * (J_Z * B[i]) * (J_Z * B[j]) + residual * value
            for (i, j), value in H_tr.items()}
    return BlockBounds(G, Phi, B, xi, H_tr, loss, J_Y, H_Y, J_Z, H_Z)


def theorem6(params: dict, X: torch.Tensor, target: torch.Tensor,
             readings: tuple[str, ...] = SIGMA_MIN_READINGS,
             per_block: bool = True) -> list[Check]:
    """Theorem 6 for one sample of ``paper_block``, for each reading of ``σ_min``:
    ``M_tr`` against ``‖H_i‖₂`` and, with ``per_block``, each output-Hessian block
    ``‖H_tr^(i,j)‖`` and loss-Hessian block the paper bounds."""
    every = {reading: theorem6_bounds(params, X, target, reading) for reading in readings}
    true: dict[str, float] = {}
    if not per_block:
        true["M_tr ≥ ‖H‖"] = hessian_norm(paper_block, params, X, target)
    else:
        H = paper_block.loss_hessian(params, X, target)
        true["M_tr ≥ ‖H‖"] = symmetric_spectral_norm(H)
        slices = block_slices(paper_block, params)
        for i, j in every[readings[0]].H_tr:
            a, b = WEIGHTS[i], WEIGHTS[j]
            true[f"H_tr({i},{j})"] = spectral_norm(paper_block.output_hessian(params, X, a, b))
            true[f"H({i},{j})"] = spectral_norm(H[slices[a], slices[b]])
    checks = []
    for reading, found in every.items():
        label = "Theorem 6" + ("" if reading == "printed" else " (σ_min = row std)")
        claimed = {"M_tr ≥ ‖H‖": found.M_tr}
        for (i, j), value in found.H_tr.items():
            claimed[f"H_tr({i},{j})"] = value
            claimed[f"H({i},{j})"] = found.loss[i, j]
        checks += [Check(label, name, claimed[name], value) for name, value in true.items()]
    return _nonzero(checks)


def softmax_jacobian_of(scores: torch.Tensor) -> torch.Tensor:
    """``∂vec_r(A)/∂vec_r(T)`` of the row softmax ``A = softmax(T)`` at ``T = scores``
    (``L×L``), shape ``(L·L) × (L·L)``: the engine's derivative, evaluated."""
    g = Graph()
    T = g.input("T", (sizes.L, sizes.L))
    softmax_rows(g, T)
    tangents = calculus.propagate(g, list(g.assigns), calculus.seed(g, T), "T")
    jacobian = g.output("jacobian", tangents.by_name["A"])
    values = evaluate(g, g.assigns, {"T": scores.double().numpy()},
                      {sizes.L: scores.shape[0]})
    n = scores.numel()
    return torch.from_numpy(values[jacobian.name].reshape(n, n))


def softmax_hessian_norm(scores: torch.Tensor) -> float:
    """``‖∂²A/∂T²‖₂`` of the row softmax at ``T = scores`` (``L×L``) in the paper's layout
    ``(L²·L²) × L²``. Row ``i`` of ``A`` depends on row ``i`` of ``T`` only, so ``MᵀM`` is
    block diagonal over the rows and the norm is the largest over ``i`` of
    ``‖[∂²A_ij/∂T_i,:²]_j‖`` (the ``L`` blocks ``L×L`` of row ``i`` stacked); each row's by
    ``torch.func.hessian`` of the softmax."""
    L = scores.shape[0]
    rows = torch.func.vmap(torch.func.hessian(lambda v: torch.softmax(v, -1)))(scores.double())
    return float(torch.linalg.matrix_norm(rows.reshape(L, L * L, L), ord=2).max())


def attention_steps(params: dict, X: torch.Tensor) -> list[Check]:
    """Steps 1–3 and 5 of Theorem 1's proof (App. B.1) at one sample, each against the true
    value: ``‖∂A/∂T‖ ≤ 1/L``, ``‖Z_1‖ ≤ ‖X‖³/L`` with ``Z_1 = (I_L⊗Xᵀ) ∂A/∂T (X⊗X)``
    (``(L·d) × d²``, from the engine's softmax Jacobian), ``‖A‖ ≤ L``, ``‖AX‖ ≤ L‖X‖`` and
    ``‖∂²A/∂T²‖ ≤ 6`` (which gives ``‖Z_2‖ ≤ 6‖X‖⁵`` by the product rule of norms)."""
    L, d = X.shape
    d_k = params["W_Q"].shape[1]
    x = spectral_norm(X)
    scores = X @ params["W_Q"] @ params["W_K"].T @ X.T / math.sqrt(d_k)
    jacobian = softmax_jacobian_of(scores)
    Z1 = torch.einsum("ja,ijkl,kp,lq->iapq", X, jacobian.reshape(L, L, L, L), X, X)
    A = torch.softmax(scores, -1)
    return [Check("Theorem 1, step 1", "‖∂A/∂T‖ ≤ 1/L", 1 / L, spectral_norm(jacobian)),
            Check("Theorem 1, step 2", "‖Z_1‖ ≤ ‖X‖³/L", x ** 3 / L,
                  spectral_norm(Z1.reshape(L * d, d * d))),
            Check("Theorem 1, step 3", "‖A‖ ≤ L", L, spectral_norm(A)),
            Check("Theorem 1, step 3", "‖A X‖ ≤ L ‖X‖", L * x, spectral_norm(A @ X)),
            Check("Theorem 1, step 5", "‖∂²A/∂T²‖ ≤ 6", 6.0, softmax_hessian_norm(scores))]


def ffn_steps(params: dict, Y: torch.Tensor) -> list[Check]:
    """The FFN factor bounds of App. B.6 at one sample, with ``S = ReLU(Y W_1) W_2 + Y``,
    each against the true value from the generated ``ffn`` (``B_i = ∂S/∂W_i``,
    ``J_SY = ∂S/∂Y``, ``ξ_ij = ∂B_i/∂W_j``, the labels of Theorem 5, whose assembly needs
    ``ξ_ij`` of layout ``(L·d·n_i) × n_j``) and the true ``‖Y‖``: ``‖B_1‖ ≤ ‖W_2‖‖Y‖``,
    ``‖J_SY‖ ≤ ‖W_2‖‖W_1‖ + 1``, ``‖ξ_12‖ ≤ √d ‖Y‖``, ``‖ξ_21‖ ≤ √d_ff ‖W_2‖``. (The proof
    of Theorem 5 swaps the labels of ``ξ_12``, ``ξ_21``; docs/ERRATA.md gives both verdicts.)"""
    L, d = Y.shape
    d_ff = params["W_1"].shape[1]
    weights = {"W_1": params["W_1"], "W_2": params["W_2"]}
    n1, n2, y = spectral_norm(params["W_1"]), spectral_norm(params["W_2"]), spectral_norm(Y)
    J_SY = ffn.jacobian(weights, Y, "X") + torch.eye(L * d, dtype=Y.dtype)
    label = "App. B.6 FFN factors"
    return [Check(label, "‖B_1‖ ≤ ‖W_2‖‖Y‖", n2 * y,
                  spectral_norm(ffn.jacobian(weights, Y, "W_1"))),
            Check(label, "‖J_SY‖ ≤ ‖W_2‖‖W_1‖ + 1", n2 * n1 + 1, spectral_norm(J_SY)),
            Check(label, "‖ξ_12‖ ≤ √d ‖Y‖", math.sqrt(d) * y,
                  spectral_norm(ffn.output_hessian(weights, Y, "W_1", "W_2"))),
            Check(label, "‖ξ_21‖ ≤ √d_ff ‖W_2‖", math.sqrt(d_ff) * n2,
                  spectral_norm(ffn.output_hessian(weights, Y, "W_2", "W_1")))]


def ingredients(params: dict, X: torch.Tensor) -> list[Check]:
    """The factor bounds Theorems 1 and 6 rest on, for one sample of ``paper_block``: the
    steps of Theorem 1's proof (:func:`attention_steps`), ``‖G_k‖``, ``‖Φ_kℓ‖``, the FFN
    factors (:func:`ffn_steps`), App. C's LayerNorm lemma at both LayerNorm inputs (with the
    true ``‖S‖``; both readings of ``σ_min``), and App. C's proposition on ``‖Y‖``, ``‖S‖``."""
    L, d = X.shape
    d_k, d_ff = params["W_Q"].shape[1], params["W_1"].shape[1]
    attention = _attention_params(params)
    norms = {"X": spectral_norm(X), **{k: spectral_norm(params[WEIGHTS[k]])
                                       for k in ("Q", "K", "V", "1", "2")}}
    checks = attention_steps(attention, X)
    G, Phi = attention_factor_bounds(norms, L, d, d_k)
    checks += g_checks(attention, X, G)
    for (k, m), value in Phi.items():
        true = spectral_norm(self_attention.output_hessian(attention, X, WEIGHTS[k],
                                                           WEIGHTS[m]))
        if value > 0 or true > 0:
            checks.append(Check("App. B.6 Φ bounds", f"‖Φ_{k}{m}‖", value, true))
    fwd = block_forward(params, X)
    checks += ffn_steps(params, fwd.Y)
    for name, U in (("Y", fwd.U), ("Z", fwd.S)):
        true_jac = spectral_norm(layernorm.jacobian({}, U, "X"))
        true_hess = spectral_norm(layernorm.output_hessian({}, U, "X", "X"))
        for reading in SIGMA_MIN_READINGS:
            label = LEMMA + ("" if reading == "printed" else " (σ_min = row std)")
            jac, hess = layernorm_lemma(spectral_norm(U), sigma_min(U, reading), L, d)
            checks.append(Check(label, f"‖J_{name}‖", jac, true_jac))
            checks.append(Check(label, f"‖H_{name}‖", hess, true_hess))
    norm_y = math.sqrt(L * d)
    norm_s = norm_y * (1 + math.sqrt(min(L, d_ff)) * norms["1"] * norms["2"])
    checks.append(Check("App. C Y, S proposition", "‖Y‖", norm_y, spectral_norm(fwd.Y)))
    checks.append(Check("App. C Y, S proposition", "‖S‖", norm_s, spectral_norm(fwd.S)))
    return _nonzero(checks)


# -- many instances ------------------------------------------------------------------------
@dataclass
class Summary:
    """One bound over many instances: every ``bound/true`` and the instances that violate
    it."""

    theorem: str
    quantity: str
    ratios: list[float]
    violations: list[dict]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def minimum(self) -> float:
        return min(self.ratios)


def survey(attention_seeds: Iterable[int], block_seeds: Iterable[int],
           progress: Callable[[str], None] = print) -> list[Summary]:
    """Theorem 1 on :func:`random_instance` ``(seed, block=False)`` for each attention seed;
    Theorem 6 (both ``σ_min`` readings) and the ingredients on ``(seed, block=True)`` for
    each block seed; every check grouped by bound."""
    found: dict[tuple[str, str], Summary] = {}

    def record(instance: Instance, checks: list[Check]) -> None:
        for c in checks:
            summary = found.setdefault((c.theorem, c.quantity),
                                       Summary(c.theorem, c.quantity, [], []))
            summary.ratios.append(c.ratio)
            if not c.holds:
                summary.violations.append({
                    "seed": instance.seed, "block": "W_1" in instance.params,
                    **instance.dims, "input_scale": instance.input_scale,
                    "weight_scale": instance.weight_scale, "bound": c.bound, "true": c.true,
                    "ratio": c.ratio})

    attention_seeds, block_seeds = list(attention_seeds), list(block_seeds)
    for seed in attention_seeds:
        instance = random_instance(seed, block=False)
        record(instance, theorem1(instance.params, instance.X, instance.target))
    progress(f"  Theorem 1 on {len(attention_seeds)} self-attention instances")
    for n, seed in enumerate(block_seeds, 1):
        instance = random_instance(seed, block=True)
        record(instance, theorem6(instance.params, instance.X, instance.target))
        record(instance, ingredients(instance.params, instance.X))
        if n % 8 == 0 or n == len(block_seeds):
            progress(f"  Theorem 6 and ingredients: {n}/{len(block_seeds)} block instances")
    return list(found.values())
