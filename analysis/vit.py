"""A small post-LN ViT on scikit-learn's 8×8 digits: Theorem 7's convergence check and the
whole model's loss Hessian.

Model (``configs/models/digits_vit.toml``, a :class:`curvgap.models.Model`): an image
(``8×8``, scaled to ``[0, 1]``) is cut into ``L = 4`` patches of ``4×4`` pixels (row-major),
embedded ``t = p W_E + b_E + P_E`` (``d = 16``), passed through one post-LN block (one head,
LayerNorm ``eps = 1e-5``, ReLU FFN with ``d_ff = 64``, ``d_k = 16``), mean-pooled over tokens
and mapped to 10 logits, ``mean_L(Z) W_H + b_H``; cross-entropy loss. Every derivative is the
whole model's, over every parameter (``n = 3,322``).

Theorem 7 of the paper: with ``ℓ_i(w)`` the per-sample loss and
``L_k(w) = (1/k) Σ_{i≤k} ℓ_i(w)``,
``|L_{k+1}(w) − L_k(w)| ≤ (2 ℓ_max + M ‖w − w*‖²) / (k + 1)`` with ``0 ≤ ℓ_i(w*) ≤ ℓ_max``
and ``‖∇²_w ℓ_i(w*)‖₂ ≤ M``; here ``w`` is every parameter of the model and ``M`` the largest
per-sample Hessian norm found by Lanczos (on the model's exact ``hvp``) on a sample of the
training set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..codegen.resources import MODEL_CONFIGS
from ..models import Model
from ..operators import CurvatureOperator
from .spectra import lanczos_spectral_norm, symmetric_spectral_norm

MODEL = Model(MODEL_CONFIGS / "digits_vit.toml")
DIMS = {"L": 4, "d": 16, "d_k": 16, "d_ff": 64}
PATCH = 4
CLASSES = 10
#: Every parameter, in the model's order (``embedding.W_E``, …, ``head.b_H``).
PARAMS = MODEL.PARAMS


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
    """Every parameter of the model, ``N(0, 1/fan_in)`` (positions ``N(0, 0.02²)``,
    biases zero)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {**DIMS, "p": PATCH * PATCH, "c": CLASSES}
    params = {}
    for (prefix, _), module in zip(MODEL.config.parts(), MODEL.modules):
        for name, shape in module.PARAMS:
            dims = [sizes[s] for s in shape]
            if name.startswith("b_"):
                value = torch.zeros(*dims, dtype=torch.float64)
            else:
                scale = 0.02 if name == "P_E" else dims[0] ** -0.5
                value = scale * torch.randn(*dims, generator=gen, dtype=torch.float64)
            params[f"{prefix}.{name}"] = value
    return params


def logits(params: dict, patches: torch.Tensor) -> torch.Tensor:
    """``(N, 10)`` logits of patches ``(N, 4, 16)``."""
    return MODEL.forward(params, patches)[:, 0]


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


def sample_hessian_operator(params: dict, patch: torch.Tensor, label: torch.Tensor
                            ) -> CurvatureOperator:
    """``∇²_w ℓ_i`` for one sample as an operator, ``w`` every parameter (``vec_r`` of each,
    concatenated in ``PARAMS`` order): products through the model's exact ``hvp``, the
    Hessian never formed."""
    X, T = patch[None], label.reshape(1, 1)
    n = sum(params[name].numel() for name in PARAMS)
    return CurvatureOperator(lambda V: MODEL.hvp(params, X, T, V), n, X.dtype, X.device)


def sample_hessian_norm(params: dict, patch: torch.Tensor, label: torch.Tensor,
                        seed: int = 0) -> float:
    """``‖∇²_w ℓ_i‖₂`` over every parameter for one sample, by Lanczos on
    :func:`sample_hessian_operator`."""
    return lanczos_spectral_norm(sample_hessian_operator(params, patch, label).to_scipy(),
                                 seed=seed, tol=1e-8)


@dataclass
class WholeHessian:
    """The model's loss Hessian over every parameter, averaged over ``samples`` training
    images, with the rows of each part (``embedding``, ``blocks.0``, ``head``) and of each
    parameter, and the relative error of its block-diagonal approximations."""

    H: torch.Tensor
    parts: dict[str, slice]
    params: dict[str, slice]
    samples: int
    norm: float
    block_diagonal: dict[str, dict[str, float]]


def _consecutive(params: dict, names: list[str]) -> list[slice]:
    """The rows of each of ``names`` in a Hessian over them, in that order (``vec_r`` each)."""
    offsets = np.cumsum([0] + [params[name].numel() for name in names])
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


def block_diagonal_error(H: torch.Tensor, slices: dict[str, slice]) -> dict[str, float]:
    """``‖H − D‖ / ‖H‖`` in the Frobenius and spectral norms, ``D`` the diagonal blocks of
    ``H`` over ``slices`` (the rest zero)."""
    D = torch.zeros_like(H)
    for rows in slices.values():
        D[rows, rows] = H[rows, rows]
    return {"frobenius": float(torch.linalg.matrix_norm(H - D) / torch.linalg.matrix_norm(H)),
            "spectral": symmetric_spectral_norm(H - D) / symmetric_spectral_norm(H)}


def whole_hessian(params: dict, data: Digits, samples: int, batch: int = 64) -> WholeHessian:
    """The exact loss Hessian of the first ``samples`` training images (their mean, computed
    ``batch`` at a time), every parameter, cross-part blocks included."""
    n = sum(params[name].numel() for name in PARAMS)
    H = torch.zeros(n, n, dtype=torch.float64)
    for start in range(0, samples, batch):
        stop = min(samples, start + batch)
        X, T = data.train_x[start:stop], data.train_y[start:stop, None]
        H += MODEL.loss_hessian(params, X, T) * (stop - start) / samples
    parts = MODEL.part_slices(params)
    by_param = dict(zip(PARAMS, _consecutive(params, PARAMS)))
    errors = {"layers": block_diagonal_error(H, parts),
              "parameters": block_diagonal_error(H, by_param)}
    return WholeHessian(H, parts, by_param, samples, symmetric_spectral_norm(H), errors)


#: The block's weights, by the short names of :mod:`.dominance`.
BLOCK_WEIGHTS = {short: f"blocks.0.W_{short}" for short in ("Q", "K", "V", "1", "2")}


def block_hessian_norms(params: dict, data: Digits, samples: int = 128
                        ) -> dict[tuple[str, str], float]:
    """``‖H_ab‖₂`` for every pair of the block's weights (short names ``Q K V 1 2``), ``H``
    the exact loss Hessian over those weights of the first ``samples`` training images (one
    batch, as the paper's Figures 3–5 take)."""
    wrt = list(BLOCK_WEIGHTS.values())
    H = MODEL.loss_hessian(params, data.train_x[:samples], data.train_y[:samples, None], wrt)
    at = dict(zip(BLOCK_WEIGHTS, _consecutive(params, wrt)))
    return {(a, b): float(torch.linalg.matrix_norm(H[at[a], at[b]], ord=2))
            for a in at for b in at}


def plot_whole_hessian(result: WholeHessian, path: Path) -> None:
    """``log10 |H_ab|`` of the whole model's Hessian, parts' boundaries in white, the
    parameters' in grey."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 7))
    with np.errstate(divide="ignore"):
        logs = np.log10(result.H.abs().numpy())
    low = np.percentile(logs[np.isfinite(logs)], 1)
    image = ax.imshow(logs, cmap="viridis", vmin=low, vmax=logs.max(), interpolation="nearest")
    for rows in list(result.params.values())[1:]:
        for line in (ax.axhline, ax.axvline):
            line(rows.start - 0.5, color="0.6", lw=0.4)
    for rows in list(result.parts.values())[1:]:
        for line in (ax.axhline, ax.axvline):
            line(rows.start - 0.5, color="white", lw=1.2)
    centres = [(s.start + s.stop) / 2 for s in result.parts.values()]
    ax.set_xticks(centres, list(result.parts), rotation=30)
    ax.set_yticks(centres, list(result.parts))
    errors = result.block_diagonal["layers"]
    ax.set_title(f"trained digits ViT: log10 |H|, every parameter (n = {result.H.shape[0]}), "
                 f"{result.samples} images\nblock-diagonal by layer: relative error "
                 f"{errors['frobenius']:.3f} (Frobenius), {errors['spectral']:.3f} (spectral)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    """Theorem 7 at ``w*`` and at ``w = w* + r u`` (``u`` a random unit direction in every
    parameter, ``r`` chosen so that ``M r² = 2 ℓ_max``)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(data.train_x.shape[0], generator=gen)
    x, y = data.train_x[order], data.train_y[order]
    with torch.no_grad():
        at_optimum = sample_losses(params, x, y)
    norms = []
    for n in range(hessian_samples):
        norms.append(sample_hessian_norm(params, x[n], y[n], seed=n))
    progress(f"    Lanczos on {hessian_samples} per-sample Hessians (n = "
             f"{sum(params[p].numel() for p in PARAMS)}): M = {max(norms):.4g}")
    loss_bound, M = float(at_optimum.max()), max(norms)
    radius = (2 * loss_bound / M) ** 0.5
    direction = {p: torch.randn(params[p].shape, generator=gen, dtype=torch.float64)
                 for p in PARAMS}
    scale = radius / float(torch.cat([v.reshape(-1) for v in direction.values()]).norm())
    moved = {p: params[p] + scale * direction[p] for p in PARAMS}
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
    """Figure 6: the gaps against ``k`` on log–log axes with Theorem 7's bound."""
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
    ax.plot(k, fit_at * trend, color="gray", lw=1, label=f"log–log trend, slope {slope:.3f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("k (training samples)")
    ax.set_ylabel("|L_(k+1)(w) − L_k(w)|")
    ax.set_title(f"ViT on digits: ℓ_max = {result.loss_bound:.3g}, M = {result.M:.3g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
