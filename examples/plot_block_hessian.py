"""
The exact Hessian of a Transformer block, and its formulas
==========================================================

The paper's block is post-LN: ``Y = LN_1(X + F(X))``, ``Z = LN_2(Y + FFN(Y))`` with one-head
self-attention ``F(X) = softmax(X W_Q W_Kᵀ Xᵀ/√d_k) X W_V``, a ReLU feed-forward network
``FFN(Y) = ReLU(Y W_1) W_2`` and the mean squared error to a target. curvgap ships its
exact derivatives as a generated module, ``curvgap.generated.torch.paper_block``, with the
formulas they come from as a LaTeX document.

This example computes the block's whole loss Hessian, splits it into its Gauss–Newton and
functional parts, checks it against autograd's double backward, and prints the formula of
one of its blocks.
"""

# %%
# The loss Hessian
# ----------------
#
# Parameters are a dict name → tensor in the order of ``PARAMS`` (shapes given by dimension
# names). Sizes are free: here ``L = 6`` tokens, width ``d = 8``, key width ``d_k = 4``,
# hidden width ``d_ff = 12``, a batch of 3.

import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from curvgap.codegen.resources import GENERATED
from curvgap.generated.torch import paper_block

print(paper_block.PARAMS)
sizes = {"L": 6, "d": 8, "d_k": 4, "d_ff": 12}
torch.manual_seed(0)
params = {name: torch.randn(*(sizes[a] for a in shape), dtype=torch.float64) / 2
          for name, shape in paper_block.PARAMS}
X = torch.randn(3, sizes["L"], sizes["d"], dtype=torch.float64)
T = torch.randn(3, sizes["L"], sizes["d"], dtype=torch.float64)

start = time.perf_counter()
H = paper_block.loss_hessian(params, X, T)
GN = paper_block.loss_hessian(params, X, T, part="gauss_newton")
functional = paper_block.loss_hessian(params, X, T, part="functional")
print(f"loss Hessian {tuple(H.shape)} and its two parts in {time.perf_counter() - start:.2f} s")
print(f"H = GN + functional: {(H - GN - functional).abs().max() / H.abs().max():.1e}")

# %%
# Against autograd
# ----------------
#
# The reference is reverse over reverse: the gradient of the loss with ``create_graph=True``,
# then one backward pass per row. (``torch.func.hessian``, forward over reverse, is not a
# reference here: forward-mode differentiation of LayerNorm is wrong in torch.) The loss is
# written from the block's definition, with nothing of curvgap's.


def block_loss(w: torch.Tensor) -> torch.Tensor:
    pieces = dict(zip(names, (p.reshape(s) for p, s in zip(w.split(counts), shapes))))
    scores = X @ pieces["W_Q"] @ pieces["W_K"].T @ X.transpose(1, 2) / sizes["d_k"] ** 0.5
    F = torch.softmax(scores, dim=-1) @ X @ pieces["W_V"]
    Y = torch.nn.functional.layer_norm(X + F, (sizes["d"],), eps=0.0)
    S = Y + torch.relu(Y @ pieces["W_1"]) @ pieces["W_2"]
    Z = torch.nn.functional.layer_norm(S, (sizes["d"],), eps=0.0)
    return ((Z - T) ** 2).mean()


names = [name for name, _ in paper_block.PARAMS]
shapes = [params[name].shape for name in names]
counts = [params[name].numel() for name in names]
w = torch.cat([params[name].reshape(-1) for name in names]).requires_grad_(True)
(g,) = torch.autograd.grad(block_loss(w), w, create_graph=True)
reference = torch.stack([torch.autograd.grad(g[i], w, retain_graph=True)[0]
                         for i in range(w.numel())])
error = (H - reference).abs().max() / reference.abs().max()
print(f"relative difference to double backward: {error:.1e}")
assert error < 1e-10

# %%
# The picture
# -----------
#
# ``|H|`` on a log scale with the parameter blocks marked, and its two parts. The functional
# part (the loss's gradient times the block's second derivative) is as large as the
# Gauss–Newton part off the diagonal blocks, and indefinite: the Gauss–Newton matrix is not
# the Hessian.

edges = np.cumsum([0] + counts)
fig, axes = plt.subplots(1, 3, figsize=(15, 5))
for ax, (title, M) in zip(axes, (("loss Hessian", H), ("Gauss–Newton part", GN),
                                 ("functional part", functional))):
    image = ax.imshow(np.log10(M.abs().numpy() + 1e-12), cmap="viridis", vmin=-5)
    for edge in edges[1:-1]:
        ax.axhline(edge - 0.5, color="w", lw=0.6)
        ax.axvline(edge - 0.5, color="w", lw=0.6)
    middles = (edges[:-1] + edges[1:]) / 2 - 0.5
    ax.set_xticks(middles, names, fontsize=9, rotation=90)
    ax.set_yticks(middles, names, fontsize=9)
    ax.set_title(title)
fig.colorbar(image, ax=axes, shrink=0.8, label="log10 |entry|")
eigenvalues = {name: torch.linalg.eigvalsh(M) for name, M in (("GN", GN), ("functional",
                                                                            functional))}
for name, e in eigenvalues.items():
    print(f"{name:10s} eigenvalues from {float(e.min()): .3g} to {float(e.max()): .3g}")

# %%
# The formulas
# ------------
#
# ``generated/latex/paper_block.tex`` states every formula the module evaluates, node by
# node, first in index form (exact, entry by entry) and, where the structure is recognised,
# in the paper's matrix form. Here is the derivative of self-attention along ``W_Q``;
# ``curvgap latex paper_block --out folder --pdf`` typesets the whole document (some 80 pages),
# and ``curvgap generate --config`` writes the document of a variant of your own.

document = (GENERATED / "latex" / "paper_block.tex").read_text()
start = document.index(r"\subsection{$W_{Q}$: Self-attention}")
print(document[start:document.index(r"\subsection", start + 1)])
