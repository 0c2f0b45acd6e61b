"""A small post-LN ViT on scikit-learn's 8×8 digits, and Theorem 7's convergence check.

Model: an image (``8×8``, scaled to ``[0, 1]``) is cut into ``L = 4`` patches of ``4×4``
pixels (row-major), embedded ``t = p E + e + P_pos`` (``d = 16``), passed through one
curvgap block (the generated ``paper_block_eps`` forward: one head, LayerNorm
``eps = 1e-5``, ReLU FFN with ``d_ff = 64``, ``d_k = 16``), mean-pooled over tokens and
mapped to 10 logits, ``logits = mean_L(Z) W_h + b_h``; cross-entropy loss.

Theorem 7 of the paper: with ``ℓ_i(w)`` the per-sample loss and
``L_k(w) = (1/k) Σ_{i≤k} ℓ_i(w)``,
``|L_{k+1}(w) − L_k(w)| ≤ (2 ℓ_max + M ‖w − w*‖²) / (k + 1)`` with ``0 ≤ ℓ_i(w*) ≤ ℓ_max``
and ``‖∇²_w ℓ_i(w*)‖₂ ≤ M``; here ``w`` is the block's parameters
(``W_Q, W_K, W_V, W_1, W_2``, ``n = 2816``), the embedding and head held at their trained
values, and ``M`` the largest per-sample Hessian norm found by Lanczos on a sample of the
training set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..generated.torch import paper_block_eps as block
from .spectra import lanczos_spectral_norm

DIMS = {"L": 4, "d": 16, "d_k": 16, "d_ff": 64}
PATCH = 4
CLASSES = 10
BLOCK_PARAMS = [name for name, _ in block.PARAMS]


@dataclass
class Digits:
    """Patches ``(N, 4, 16)`` and labels ``(N,)`` of a training and a test split."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def digits(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """``sklearn.datasets.load_digits`` (1,797 images, shipped with scikit-learn), pixels
    scaled to ``[0, 1]``, cut into ``4×4`` patches, split at random."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float64)          # N × 8 × 8
    n, side = images.shape[0], images.shape[1] // PATCH
    patches = (images.reshape(n, side, PATCH, side, PATCH).permute(0, 1, 3, 2, 4)
               .reshape(n, side * side, PATCH * PATCH))
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(round(n * (1 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Digits(patches[train], labels[train], patches[test], labels[test])


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """Embedding, position, block and head parameters, ``N(0, 1/fan_in)`` (position
    ``N(0, 0.02²)``, biases zero)."""
    gen = torch.Generator().manual_seed(seed)
    d = DIMS["d"]

    def normal(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    params = {"embed": normal(PATCH * PATCH, d, scale=PATCH ** -1.0),
              "embed_bias": torch.zeros(d, dtype=torch.float64),
              "position": normal(DIMS["L"], d, scale=0.02)}
    for name, shape in block.PARAMS:
        params[name] = normal(*(DIMS[s] for s in shape), scale=DIMS[shape[0]] ** -0.5)
    params["head"] = normal(d, CLASSES, scale=d ** -0.5)
    params["head_bias"] = torch.zeros(CLASSES, dtype=torch.float64)
    return params


def logits(params: dict, patches: torch.Tensor) -> torch.Tensor:
    """``(N, 10)`` logits of patches ``(N, 4, 16)``."""
    tokens = patches @ params["embed"] + params["embed_bias"] + params["position"]
    Z = block.forward({name: params[name] for name in BLOCK_PARAMS}, tokens)
    return Z.mean(dim=1) @ params["head"] + params["head_bias"]


def sample_losses(params: dict, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``ℓ_i``, the cross-entropy of each sample, ``(N,)``."""
    return torch.nn.functional.cross_entropy(logits(params, patches), labels, reduction="none")


def accuracy(params: dict, patches: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((logits(params, patches).argmax(-1) == labels).double().mean())


def train(data: Digits, epochs: int, batch: int = 64, lr: float = 3e-3, seed: int = 0,
          progress: Callable[[str], None] = print) -> tuple[dict, list[float]]:
    """Adam on the mean cross-entropy over minibatches; the trained parameters and the
    loss of every step."""
    params = {k: v.clone().requires_grad_(True) for k, v in init_params(seed).items()}
    optimiser = torch.optim.Adam(params.values(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    n = data.train_x.shape[0]
    for epoch in range(epochs):
        for rows in torch.randperm(n, generator=gen).split(batch):
            loss = sample_losses(params, data.train_x[rows], data.train_y[rows]).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
        if (epoch + 1) % max(1, epochs // 4) == 0:
            trained = {k: v.detach() for k, v in params.items()}
            progress(f"    ViT epoch {epoch + 1}/{epochs}: loss {losses[-1]:.3f}, test accuracy "
                     f"{accuracy(trained, data.test_x, data.test_y):.3f}")
    return {k: v.detach() for k, v in params.items()}, losses


def sample_hvp(params: dict, patch: torch.Tensor, label: torch.Tensor
               ) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
    """``(v ↦ ∇²_w ℓ_i v, n)`` for one sample, ``w`` the block's parameters (``vec_r`` of
    each, concatenated in ``PARAMS`` order): double backward through a gradient kept with
    its graph, the Hessian never formed."""
    weights = [params[name].clone().requires_grad_(True) for name in BLOCK_PARAMS]
    merged = {**params, **dict(zip(BLOCK_PARAMS, weights))}
    loss = sample_losses(merged, patch[None], label[None])[0]
    gradient = torch.autograd.grad(loss, weights, create_graph=True)
    sizes = [w.numel() for w in weights]

    def matvec(v: np.ndarray) -> np.ndarray:
        pieces = torch.as_tensor(np.ascontiguousarray(v).reshape(-1)).split(sizes)
        hv = torch.autograd.grad(gradient, weights, [p.reshape(w.shape) for p, w in
                                                     zip(pieces, weights)], retain_graph=True)
        return torch.cat([h.reshape(-1) for h in hv]).numpy()

    return matvec, sum(sizes)


def sample_hessian_norm(params: dict, patch: torch.Tensor, label: torch.Tensor,
                        seed: int = 0) -> float:
    """``‖∇²_w ℓ_i‖₂`` over the block's parameters for one sample, by Lanczos on
    :func:`sample_hvp`."""
    matvec, n = sample_hvp(params, patch, label)
    return lanczos_spectral_norm(matvec, n, seed=seed, tol=1e-8)


@dataclass
class Convergence:
    """Theorem 7's quantities on the training set in a random order."""

    k: np.ndarray                 # 1 .. N−1
    gap_optimum: np.ndarray       # |L_{k+1}(w*) − L_k(w*)|
    gap_perturbed: np.ndarray     # |L_{k+1}(w) − L_k(w)|, ‖w − w*‖ = radius
    loss_bound: float             # ℓ_max = max_i ℓ_i(w*)
    M: float                      # max over the sampled per-sample Hessian norms
    hessian_norms: list[float]
    radius: float
    slope_optimum: float
    slope_perturbed: float
    violations_optimum: int
    violations_perturbed: int

    def bound(self, radius: float) -> np.ndarray:
        return theorem7_bound(self.k, self.loss_bound, self.M, radius)


def theorem7_bound(k: np.ndarray, loss_bound: float, M: float, radius: float) -> np.ndarray:
    """``(2 ℓ_max + M ‖w − w*‖²) / (k + 1)``."""
    return (2 * loss_bound + M * radius ** 2) / (k + 1)


def _gaps(losses: torch.Tensor) -> np.ndarray:
    """``|L_{k+1} − L_k|`` for ``k = 1 .. N−1`` with ``L_k`` the mean of the first ``k``."""
    running = losses.cumsum(0) / torch.arange(1, losses.numel() + 1, dtype=losses.dtype)
    return (running[1:] - running[:-1]).abs().numpy()


def _slope(k: np.ndarray, gaps: np.ndarray, start: int = 10) -> float:
    keep = (k >= start) & (gaps > 0)
    return float(np.polyfit(np.log(k[keep]), np.log(gaps[keep]), 1)[0])


def convergence(params: dict, data: Digits, hessian_samples: int, seed: int = 0,
                progress: Callable[[str], None] = print) -> Convergence:
    """Theorem 7 at ``w*`` and at ``w = w* + r u`` (``u`` a random unit direction in the
    block's parameters, ``r`` chosen so that ``M r² = 2 ℓ_max``)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(data.train_x.shape[0], generator=gen)
    x, y = data.train_x[order], data.train_y[order]
    with torch.no_grad():
        at_optimum = sample_losses(params, x, y)
    norms = []
    for n in range(hessian_samples):
        norms.append(sample_hessian_norm(params, x[n], y[n], seed=n))
    progress(f"    Lanczos on {hessian_samples} per-sample Hessians (n = "
             f"{sum(params[p].numel() for p in BLOCK_PARAMS)}): M = {max(norms):.4g}")
    loss_bound, M = float(at_optimum.max()), max(norms)
    radius = (2 * loss_bound / M) ** 0.5
    direction = {p: torch.randn(params[p].shape, generator=gen, dtype=torch.float64)
                 for p in BLOCK_PARAMS}
    scale = radius / float(torch.cat([v.reshape(-1) for v in direction.values()]).norm())
    moved = {**params, **{p: params[p] + scale * direction[p] for p in BLOCK_PARAMS}}
    with torch.no_grad():
        at_moved = sample_losses(moved, x, y)
    k = np.arange(1, x.shape[0])
    optimum, perturbed = _gaps(at_optimum), _gaps(at_moved)
    exceeds = [int((gaps > theorem7_bound(k, loss_bound, M, r)).sum())
               for gaps, r in ((optimum, 0.0), (perturbed, radius))]
    return Convergence(k, optimum, perturbed, loss_bound, M, norms, radius,
                       _slope(k, optimum), _slope(k, perturbed), *exceeds)


def _ema(values: np.ndarray, weight: float = 0.05) -> np.ndarray:
    out, current = np.empty_like(values), float(np.log(values[0] + 1e-300))
    for n, value in enumerate(np.log(values + 1e-300)):
        current = (1 - weight) * current + weight * value
        out[n] = current
    return np.exp(out)


def plot_convergence(result: Convergence, path: Path) -> None:
    """Figure 5: the gaps against ``k`` on log–log axes with Theorem 7's bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    k = result.k
    for gaps, radius, colour, name in ((result.gap_optimum, 0.0, "tab:blue", "w = w*"),
                                       (result.gap_perturbed, result.radius, "tab:orange",
                                        f"‖w − w*‖ = {result.radius:.3g}")):
        ax.scatter(k, gaps, s=3, alpha=0.2, color=colour)
        ax.plot(k, _ema(gaps), color=colour, label=f"|L_(k+1) − L_k|, {name} (EMA)")
        ax.plot(k, result.bound(radius), "--", color=colour,
                label=f"Theorem 7 bound, {name}")
    slope = result.slope_optimum
    trend = np.exp(np.polyval([slope, 0], np.log(k)))
    fit_at = np.exp(np.median(np.log(result.gap_optimum[9:] + 1e-300))) / np.median(trend[9:])
    ax.plot(k, fit_at * trend, color="gray", lw=1, label=f"log–log trend, slope {slope:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("k (training samples)")
    ax.set_ylabel("|L_(k+1)(w) − L_k(w)|")
    ax.set_title(f"ViT on digits: ℓ_max = {result.loss_bound:.3g}, M = {result.M:.3g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
