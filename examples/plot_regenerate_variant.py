"""
Regenerating after an architecture change
=========================================

A change of architecture (pre-LN instead of post-LN, several heads, another activation,
RMSNorm, rotary embeddings...) changes every second derivative of the block. With curvgap
it is a change of configuration: write the variant as a TOML file, run ``curvgap generate
--config``, and import the module it writes; the engine re-derives every formula. The same
variant written as an ``nn.Module`` goes through ``curvgap.curvature`` instead, with no
config at all.

This example takes the paper's post-LN block to a pre-LN block with two heads, an output
projection and a tanh-GELU feed-forward network, generates it, checks it against autograd,
and compares the two blocks' curvature.
"""

# %%
# The variant as a config
# -----------------------
#
# A config is data (TOML, never evaluated). Options left out keep the paper's defaults; an
# option the engine cannot derive is refused with a message naming it.

import importlib.util
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import curvgap
from curvgap.analysis.spectra import block_norms, block_slices
from curvgap.codegen.generate import generate
from curvgap.generated.torch import paper_block

folder = Path(tempfile.mkdtemp())
config = folder / "pre_ln_block.toml"
config.write_text("""
name = "pre_ln_block"
norm_position = "pre"       # Y = X + F(LN_1(X)), Z = Y + FFN(LN_2(Y))
heads = 2
out_proj = true             # W_O after the concatenated heads
activation = "gelu_tanh"
eps = 1e-5
""")

start = time.perf_counter()
written = generate([config], out_dir=folder / "generated")
print(f"generated in {time.perf_counter() - start:.1f} s:")
for path in written:
    print("  ", path.relative_to(folder))

# %%
# The files are plain modules (numpy or torch and the standard library only): copy one into
# a project, or import it from where it was written.

path = folder / "generated" / "torch" / "pre_ln_block.py"
spec = importlib.util.spec_from_file_location("pre_ln_block", path)
pre_ln_block = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pre_ln_block)
print(pre_ln_block.__doc__.split("\n\n")[1])
print(pre_ln_block.PARAMS)

# %%
# Against autograd
# ----------------
#
# The loss Hessian of the generated module against double backward on the same block
# written with torch's own layers (``nn.MultiheadAttention`` would do as well; the plain
# form shows what the config means). Sizes: ``L = 5``, ``d = 6``, ``d_k = 4`` per head,
# ``d_ff = 10``, a batch of 2.

sizes = {"L": 5, "d": 6, "d_k": 4, "d_ff": 10, "h": 2}


def shape_of(dims: tuple[str, ...]) -> tuple[int, ...]:
    """A shape from dimension names such as ``"h*d_k"``."""
    return tuple(int(np.prod([sizes[part] for part in name.split("*")])) for name in dims)


torch.manual_seed(0)
params = {name: torch.randn(shape_of(dims), dtype=torch.float64) / 2
          for name, dims in pre_ln_block.PARAMS}
X = torch.randn(2, sizes["L"], sizes["d"], dtype=torch.float64)
T = torch.randn(2, sizes["L"], sizes["d"], dtype=torch.float64)
H = pre_ln_block.loss_hessian(params, X, T)
print(f"loss Hessian {tuple(H.shape)}")


class PreLNBlock(torch.nn.Module):
    """The config's block in plain torch: parameters in the module's own layout, ``X W``."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        for name, value in weights.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        h, d, d_k = sizes["h"], sizes["d"], sizes["d_k"]
        U = torch.nn.functional.layer_norm(X, (d,), eps=1e-5)
        B, L, _ = X.shape
        Q = (U @ self.W_Q).reshape(B, L, h, d_k).transpose(1, 2)
        K = (U @ self.W_K).reshape(B, L, h, d_k).transpose(1, 2)
        V = (U @ self.W_V).reshape(B, L, h, d // h).transpose(1, 2)
        A = torch.softmax(Q @ K.transpose(-1, -2) / d_k ** 0.5, dim=-1)
        Y = X + (A @ V).transpose(1, 2).reshape(B, L, d) @ self.W_O
        N = torch.nn.functional.layer_norm(Y, (d,), eps=1e-5)
        return Y + torch.nn.functional.gelu(N @ self.W_1, approximate="tanh") @ self.W_2


block = PreLNBlock(params)
w = torch.cat([p.detach().reshape(-1) for p in block.parameters()]).requires_grad_(True)
names = [name for name, _ in block.named_parameters()]
shapes = [p.shape for p in block.parameters()]
pieces = dict(zip(names, (p.reshape(s) for p, s in zip(w.split([s.numel() for s in shapes]),
                                                        shapes))))
loss = torch.nn.functional.mse_loss(torch.func.functional_call(block, pieces, (X,)), T)
(g,) = torch.autograd.grad(loss, w, create_graph=True)
reference = torch.stack([torch.autograd.grad(g[i], w, retain_graph=True)[0]
                         for i in range(w.numel())])
error = (H - reference).abs().max() / reference.abs().max()
print(f"generated module vs double backward: {error:.1e}")
assert error < 1e-10

# %%
# The same variant as a module
# ----------------------------
#
# No config is needed when the variant is already an ``nn.Module``: ``curvgap.curvature``
# reads what its forward computes and derives the same formulas (the first call generates
# the module's code and caches it on disk; later calls, and later sessions, reuse it).

start = time.perf_counter()
from_module = curvgap.curvature(block).loss_hessian(X, T)
print(f"curvgap.curvature on the module: {time.perf_counter() - start:.1f} s, "
      f"vs the config's module {(from_module - H).abs().max() / H.abs().max():.1e}")

# %%
# What changed
# ------------
#
# The spectral norm of each parameter block of the loss Hessian, for the paper's post-LN
# block (one head, ReLU, ``eps = 0``) and for the variant, on the same input and target.
# In the post-LN block the last LayerNorm sits right before the loss and bounds how far the
# output can move; in the pre-LN block the residual stream reaches the loss unnormalised,
# and every block of the Hessian is about an order of magnitude larger.

paper_sizes = {**sizes, "h": 1}
paper_params = {name: torch.randn(*(paper_sizes[a] for a in dims), dtype=torch.float64) / 2
                for name, dims in paper_block.PARAMS}
H_paper = paper_block.loss_hessian(paper_params, X, T)

fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
panels = (("paper_block (post-LN)", paper_block, paper_params, H_paper),
          ("pre_ln_block (config above)", pre_ln_block, params, H))
for ax, (title, module, weights, matrix) in zip(axes, panels):
    names = [name for name, _ in module.PARAMS]
    found = block_norms(matrix, block_slices(module, weights))
    norms = np.array([[found[a, b]["spectral"] for b in names] for a in names])
    logs = np.log10(norms + 1e-300)
    image = ax.imshow(logs, cmap="magma", vmin=-1, vmax=1.5)
    for a in range(len(names)):
        for b in range(len(names)):
            ax.text(b, a, f"{norms[a, b]:.1g}", ha="center", va="center", fontsize=8,
                    color="black" if logs[a, b] > 0.25 else "white")
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(names)), names)
    ax.set_title(title)
fig.colorbar(image, ax=axes, shrink=0.85, label="log10 ‖block‖₂")
