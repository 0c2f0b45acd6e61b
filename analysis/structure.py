"""Block structure of the post-LN block's loss Hessian (the paper's Figures 3–5).

The block (``paper_block``: one head, LayerNorm with ``eps = 0``, ReLU FFN, MSE) is trained
by Adam on a regression task: inputs ``X ~ N(0, 1)`` (``B×L×d``), targets from a teacher
block of the same shape plus noise, ``T = Z_teacher(X) + 0.1 ε``. The exact loss Hessian
``H`` (``n×n``, ``n = 2 d d_k + d² + 2 d d_ff``) of one batch comes from the generated
``loss_hessian`` at initialisation and after training; blocks ``H_ij = ∂²ℓ/∂W_i∂W_j``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..generated.torch import paper_block
from ..operators import hessian_operator
from .bounds import block_forward
from .spectra import (
    block_norms,
    block_slices,
    lanczos_spectral_norm,
    symmetric_spectral_norm,
)

LABELS = {"W_Q": "$W_Q$", "W_K": "$W_K$", "W_V": "$W_V$", "W_1": "$W_1$", "W_2": "$W_2$"}


def _random_params(dims: dict[str, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``W ~ N(0, 1/fan_in)`` for every parameter of ``paper_block``."""
    return {name: torch.randn(*(dims[s] for s in shape), generator=gen, dtype=torch.float64)
            / dims[shape[0]] ** 0.5 for name, shape in paper_block.PARAMS}


@dataclass
class Trained:
    """A regression run: the parameters before and after, one evaluation batch, losses."""

    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    X: torch.Tensor
    target: torch.Tensor
    losses: list[float] = field(default_factory=list)


def train_regression(dims: dict[str, int], samples: int, steps: int, batch: int = 32,
                     lr: float = 1e-2, seed: int = 0,
                     progress: Callable[[str], None] = print) -> Trained:
    """Adam on the generated ``loss`` (batch-mean MSE) of ``paper_block`` for ``steps``
    minibatches of ``batch`` out of ``samples`` teacher-labelled inputs; the evaluation
    batch is the first ``batch`` samples."""
    gen = torch.Generator().manual_seed(seed)
    teacher = _random_params(dims, gen)
    X = torch.randn(samples, dims["L"], dims["d"], generator=gen, dtype=torch.float64)
    target = (paper_block.forward(teacher, X)
              + 0.1 * torch.randn(X.shape, generator=gen, dtype=torch.float64))
    initial = _random_params(dims, gen)
    params = {k: v.clone().requires_grad_(True) for k, v in initial.items()}
    optimiser = torch.optim.Adam(params.values(), lr=lr)
    losses = []
    for step in range(steps):
        rows = torch.randint(0, samples, (batch,), generator=gen)
        loss = paper_block.loss(params, X[rows], target[rows])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, steps // 4) == 0:
            progress(f"    regression step {step + 1}/{steps}: loss {losses[-1]:.4f}")
    final = {k: v.detach() for k, v in params.items()}
    return Trained(initial, final, X[:batch], target[:batch], losses)


@dataclass
class Structure:
    """The loss Hessian of one batch and its block norms."""

    H: torch.Tensor
    slices: dict[str, slice]
    norms: dict[tuple[str, str], dict]
    dense_norm: float
    lanczos_norm: float
    loss: float
    variances: dict[str, float]


def smallest_row_variances(params: dict, X: torch.Tensor) -> dict[str, float]:
    """The paper's Assumption 2 in numbers: ``min σ_i²`` over the batch's samples and rows,
    ``σ_i² = (1/d) Σ_j (U_ij − μ_i)²``, of both LayerNorm inputs, ``X + F(X)`` and
    ``Y + FFN(Y)``."""
    fwd = block_forward(params, X)
    return {"X + F(X)": float(fwd.U.var(-1, unbiased=False).min()),
            "Y + FFN(Y)": float(fwd.S.var(-1, unbiased=False).min())}


def structure(params: dict, X: torch.Tensor, target: torch.Tensor) -> Structure:
    """``H`` from ``loss_hessian``, every block's spectral and Frobenius norm, ``‖H‖₂``
    twice (dense ``eigvalsh`` of ``H`` and Lanczos on the generated ``hvp``), and the
    smallest row variances of the LayerNorm inputs."""
    H = paper_block.loss_hessian(params, X, target)
    slices = block_slices(paper_block, params)
    lanczos = lanczos_spectral_norm(hessian_operator(paper_block, params, X, target).to_scipy())
    return Structure(H, slices, block_norms(H, slices), symmetric_spectral_norm(H), lanczos,
                     float(paper_block.loss(params, X, target)),
                     smallest_row_variances(params, X))


def _ticks(ax, slices: dict[str, slice]) -> None:
    centres = [(s.start + s.stop) / 2 for s in slices.values()]
    ax.set_xticks(centres, [LABELS[n] for n in slices])
    ax.set_yticks(centres, [LABELS[n] for n in slices])
    for s in list(slices.values())[1:]:
        for line in (ax.axhline, ax.axvline):
            line(s.start - 0.5, color="white", lw=0.8)


def plot_heatmaps(states: dict[str, Structure], path: Path) -> None:
    """``log10 |H_ab|`` entry by entry (zeros blank), one panel per state, block boundaries
    drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(states), figsize=(6.2 * len(states), 5.4))
    for ax, (title, state) in zip(np.atleast_1d(axes), states.items()):
        with np.errstate(divide="ignore"):
            logs = np.log10(state.H.abs().numpy())
        low = np.percentile(logs[np.isfinite(logs)], 1)        # colour range: 1st pct. – max
        image = ax.imshow(logs, cmap="viridis", vmin=low, vmax=logs.max())
        _ticks(ax, state.slices)
        ax.set_title(f"{title}: log10 |H| (n = {state.H.shape[0]})")
        fig.colorbar(image, ax=ax, shrink=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_block_norms(states: dict[str, Structure], path: Path) -> None:
    """log10 of each block's spectral and Frobenius norm (rows), per state (columns)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("spectral", "frobenius")
    fig, axes = plt.subplots(2, len(states), figsize=(5.6 * len(states), 10), squeeze=False)
    for col, (title, state) in enumerate(states.items()):
        names = list(state.slices)
        for row, kind in enumerate(kinds):
            values = np.array([[state.norms[a, b][kind] for b in names] for a in names])
            logs = np.log10(values)
            ax = axes[row, col]
            image = ax.imshow(logs, cmap="magma")
            # dark text on the bright end of the colour map, white on the dark end
            middle = (logs.min() + logs.max()) / 2
            for a in range(len(names)):
                for b in range(len(names)):
                    ax.text(b, a, f"{values[a, b]:.2g}", ha="center", va="center",
                            color="black" if logs[a, b] > middle else "white", fontsize=8.5)
            ax.set_xticks(range(len(names)), [LABELS[n] for n in names])
            ax.set_yticks(range(len(names)), [LABELS[n] for n in names])
            ax.set_title(f"{title}\n{kind} norm of each block", fontsize=11)
            fig.colorbar(image, ax=ax, shrink=0.8, label="log10 of the norm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
