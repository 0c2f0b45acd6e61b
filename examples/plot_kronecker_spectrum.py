"""
The Kronecker V–V block and its whole spectrum at GPT-2 width
==============================================================

Some blocks of a Transformer's loss Hessian are exactly Kronecker products. In a
self-attention head under the squared error, the output ``A X W_V`` is linear in the value
weight ``W_V``, so the Hessian block of ``W_V`` with itself is the Gauss–Newton block, and
since ``∂²ℓ/∂Z²`` is a multiple of the identity it factors:

.. math::

    H_{VV} = \\frac{2}{B L d} \\sum_b (A_b X_b)^\\top (A_b X_b) \\otimes I_d

(in the ``(in, out)`` layout; ``nn.Linear`` holds the weight as ``(out, in)``, which swaps
the factors). curvgap finds such blocks in the derived expressions and returns their factors
with ``kronecker_block``. At GPT-2 small's width, ``d = 768``, the block has
``768² = 589,824`` rows: its dense form would take 2.8 TB, its factors take 4.7 MB, and all
589,824 eigenvalues are the products ``λ_i(A) μ_j(B)`` of the factors' eigenvalues.
"""

# %%
# One attention head at width 768
# -------------------------------
#
# A BERT self-attention layer with one head of width 768 (separate query, key and value
# projections, each with a bias), random weights, 64 sequences of 16 tokens, and the mean
# squared error to a random target. The block is a single Kronecker product for one head:
# with ``h`` heads the value weight's output columns split among heads that each have their
# own attention matrix, so the block is block-diagonal over heads, a sum of ``h`` products,
# and ``kronecker_block`` refuses it.

import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers

import curvgap


def attention(width: int) -> torch.nn.Module:
    config = transformers.BertConfig(hidden_size=width, num_attention_heads=1,
                                     attention_probs_dropout_prob=0.0,
                                     attn_implementation="eager")
    layer = transformers.models.bert.modeling_bert.BertSelfAttention(config)
    return layer.to(torch.float64).eval()


torch.manual_seed(0)
d, B, L = 768, 64, 16
layer = attention(d)
X = torch.randn(B, L, d, dtype=torch.float64)
T = torch.randn(B, L, d, dtype=torch.float64)

c = curvgap.curvature(layer)
start = time.perf_counter()
block = c.kronecker_block(X, T, "value.weight")
print(f"kronecker_block: {len(block.products)} product, factors of shapes "
      f"{block.left_shape} and {block.right_shape}, block {block.shape} "
      f"({time.perf_counter() - start:.2f} s)")
((left, right),) = block.products
print(f"left factor: {'identity' if left is None else tuple(left.shape)}, "
      f"right factor: {'identity' if right is None else tuple(right.shape)}")

# %%
# ``None`` stands for an identity that is never formed. The other factor, ``G``, is a
# ``768 × 768`` Gram matrix of the attention-weighted inputs ``A_b X_b``; it has rank at most
# ``B·L``, which is why this example takes ``B·L = 1024 ≥ 768`` rows: with fewer, most of the
# spectrum is exactly zero.

G = right if left is None else left
start = time.perf_counter()
spectrum = block.eigvalsh()  # every λ_i(G) · 1, each with multiplicity 768
G_values = torch.linalg.eigvalsh(G)
print(f"all {spectrum.numel():,} eigenvalues from one 768 × 768 eigendecomposition "
      f"({time.perf_counter() - start:.2f} s)")
print(f"largest {float(spectrum[-1]):.6e}, smallest {float(spectrum[0]):.6e}, "
      f"condition number {block.condition():.3e}")

# %%
# Against Hessian-vector products at width 768
# --------------------------------------------
#
# ``c.hvp`` with ``wrt="value.weight"`` multiplies by the same block of the Hessian (the
# Hessian restricted to the value weight), computed from the layer's exact second-order
# sweeps, never from the factors. The Kronecker product acts as ``vec(G U)`` or ``vec(U Gᵀ)``
# on a weight-shaped ``U``.

V = torch.randn(d * d, 3, dtype=torch.float64)
start = time.perf_counter()
through_factors = block @ V
through_hvp = c.hvp(X, T, V, wrt="value.weight")
print(f"3 products at width 768: relative difference "
      f"{(through_factors - through_hvp).abs().max() / through_hvp.abs().max():.1e} "
      f"({time.perf_counter() - start:.2f} s)")

# %%
# The factors also solve with the block at the cost of two small solves: a Newton step
# restricted to the value weight, ``x = H_VV⁻¹ g``, checked by multiplying back with
# ``hvp``.

g = c.gradient(X, T, wrt="value.weight")
x = block.solve(g)
residual = torch.linalg.norm(c.hvp(X, T, x, wrt="value.weight") - g) / torch.linalg.norm(g)
print(f"Newton step on the V–V block: relative residual {residual:.1e}")

# %%
# Against the dense block at a smaller width
# ------------------------------------------
#
# At width 24 the dense ``576 × 576`` block is small enough for autograd: the Hessian of the
# loss with respect to the value weight alone, by reverse-over-reverse
# (``torch.autograd.functional.hessian``), and its eigenvalues from a dense solver.

small = attention(24)
Xs = torch.randn(8, 16, 24, dtype=torch.float64)
Ts = torch.randn(8, 16, 24, dtype=torch.float64)
weight = small.value.weight.detach()


def value_loss(w: torch.Tensor) -> torch.Tensor:
    output = torch.func.functional_call(small, {"value.weight": w.reshape(weight.shape)},
                                        (Xs,))
    output = output[0] if isinstance(output, tuple) else output
    return torch.nn.functional.mse_loss(output, Ts)


dense = torch.autograd.functional.hessian(value_loss, weight.reshape(-1))
small_block = curvgap.curvature(small).kronecker_block(Xs, Ts, "value.weight")
block_error = (small_block.to_dense() - dense).abs().max() / dense.abs().max()
eigenvalue_error = ((small_block.eigvalsh() - torch.linalg.eigvalsh(dense)).abs().max()
                    / dense.abs().max())
print(f"width 24, relative difference to autograd: block {block_error:.1e}, "
      f"eigenvalues {eigenvalue_error:.1e}")

# %%
# The picture
# -----------
#
# Left, the eigenvalues of the factor ``G`` at width 768; middle, the histogram of the whole
# spectrum of the 589,824-row block (each eigenvalue of ``G`` 768 times); right, at width 24,
# the eigenvalues from the factors against those of autograd's dense block.
#
# With random weights the attention is nearly uniform, so every row of ``A_b X_b`` is close
# to the mean token of sequence ``b``: each of the 64 sequences adds one large eigenvalue to
# ``G`` (the separate group at the top of the spectrum, 64 × 768 eigenvalues of the block),
# and what differs between the rows adds the bulk below it.

large = int((G_values > 0.3 * G_values[-1]).sum())
print(f"eigenvalues of G above 0.3 × the largest: {large} (sequences: {B})")

fig, (a, b, e) = plt.subplots(1, 3, figsize=(13, 4))
a.semilogy(np.arange(1, d + 1), G_values.numpy()[::-1], color="C0")
a.axvline(B, color="C3", lw=0.8, ls="--", label=f"{B} sequences")
a.set_xlabel("index")
a.set_ylabel("eigenvalue")
a.set_title("eigenvalues of the factor G (768 × 768)")
a.legend()

values = spectrum.numpy()
bins = np.geomspace(values.min(), values.max(), 80)
b.hist(values, bins=bins, color="C0")
b.set_xscale("log")
b.set_xlabel("eigenvalue")
b.set_ylabel("count")
b.set_title(f"all {values.size:,} eigenvalues of the V–V block")

reference = torch.linalg.eigvalsh(dense).numpy()
e.loglog(reference, small_block.eigvalsh().numpy(), ".", ms=3)
e.loglog([reference.min(), reference.max()], [reference.min(), reference.max()], "k", lw=0.8)
e.set_xlabel("eigenvalue of the dense block (autograd)")
e.set_ylabel("eigenvalue from the factors")
e.set_title("width 24: 576 eigenvalues")
fig.tight_layout()
