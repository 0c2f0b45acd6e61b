"""
A Hugging Face model's top eigenvalues and spectral density
============================================================

The loss Hessian of a whole language model is far too large to form, but everything a
spectral study needs is a product of it with a vector. ``curvgap.curvature`` reads a
Hugging Face model's forward pass and gives exact Hessian-vector products of it;
``hessian_operator`` wraps them as a linear operator that scipy's solvers take.

This example takes a small GPT-2 language model with random weights, finds the largest (and
the smallest) eigenvalues of its cross-entropy loss Hessian with scipy's ``eigsh``
(Lanczos), estimates the whole spectral density by stochastic Lanczos quadrature, and checks
the top eigenvalue against the same solver run on products computed by autograd (reverse
over reverse).
"""

# %%
# A small GPT-2 with its language-model head
# ------------------------------------------
#
# Any ``GPT2Config`` gives a model with random weights and no download. The model reads
# token ids; curvgap reads them as one-hot rows over the vocabulary, so the token table is a
# parameter like any other (here tied to the output head, as in GPT-2: one parameter, its
# derivatives summed over the two places it is read). The loss is the mean cross-entropy of
# next-token prediction over every position.

import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import transformers
from scipy.linalg import eigh_tridiagonal
from scipy.sparse.linalg import LinearOperator, eigsh

import curvgap

torch.manual_seed(0)
config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_inner=32, n_positions=16,
                                 vocab_size=40, bos_token_id=0, eos_token_id=0)
model = transformers.GPT2LMHeadModel(config).to(torch.float64).eval()

ids = torch.randint(0, config.vocab_size, (4, 9))
X, T = ids[:, :-1], ids[:, 1:]  # predict each next token: 4 sequences of 8 positions
n = sum(p.numel() for p in model.parameters())
print(f"{n} parameters")

c = curvgap.curvature(model, loss="cross_entropy")
print(f"loss {c.loss(X, T, use_cache=False):.6f}")

# %%
# The top eigenvalues
# -------------------
#
# ``hessian_operator`` fixes the batch and the weights and gives an ``n × n`` operator that is
# never formed; ``to_scipy()`` makes it a ``scipy.sparse.linalg.LinearOperator``. Each
# product runs the model's forward pass once and its exact second-order sweeps.

H = c.hessian_operator(X, T, use_cache=False)
start = time.perf_counter()
v0 = np.random.default_rng(0).standard_normal(n)
top = eigsh(H.to_scipy(), k=4, which="LA", v0=v0, tol=1e-10, return_eigenvectors=False)
top = np.sort(top)[::-1]
bottom = eigsh(H.to_scipy(), k=1, which="SA", v0=v0, tol=1e-10, return_eigenvectors=False)[0]
print(f"top eigenvalues: {np.array2string(top, precision=6)}, smallest: {bottom:.6f} "
      f"({time.perf_counter() - start:.1f} s)")

# %%
# The spectral density by stochastic Lanczos quadrature
# -----------------------------------------------------
#
# ``m`` steps of Lanczos from a random unit vector ``v`` give a tridiagonal matrix whose
# eigenvalues ``θ_k`` (Ritz values) and the squared first components ``τ_k`` of its
# eigenvectors are an ``m``-point Gauss quadrature of the measure
# ``Σ_i (vᵀu_i)² δ(t − λ_i)``; averaged over random ``v`` it estimates the spectral density
# ``(1/n) Σ_i δ(t − λ_i)`` (Ghorbani, Krishnan and Xiao, 2019; Lin, Saad and Yang, 2016).
# A Gaussian of width ``σ`` smooths the nodes into a curve. Below it is written with numpy
# on the operator's products; all start vectors advance together, so each Lanczos step is one
# product of the operator with a matrix of ``s`` columns.


def slq(matmat, n: int, steps: int, vectors: int, seed: int = 0):
    """Ritz values and quadrature weights, each ``(vectors, steps)``, of ``steps`` Lanczos
    steps (with full reorthogonalisation) from ``vectors`` Rademacher start vectors."""
    rng = np.random.default_rng(seed)
    Q = [rng.choice([-1.0, 1.0], size=(n, vectors)) / np.sqrt(n)]
    alpha, beta = np.zeros((steps, vectors)), np.zeros((steps, vectors))
    for j in range(steps):
        W = matmat(Q[j])
        alpha[j] = np.einsum("ns,ns->s", Q[j], W)
        basis = np.stack(Q)  # (j + 1, n, s)
        for _ in range(2):  # Gram–Schmidt twice against every earlier Lanczos vector
            W = W - np.einsum("jns,js->ns", basis, np.einsum("jns,ns->js", basis, W))
        beta[j] = np.linalg.norm(W, axis=0)
        Q.append(W / beta[j])
    nodes, weights = [], []
    for s in range(vectors):
        theta, U = eigh_tridiagonal(alpha[:, s], beta[:-1, s])
        nodes.append(theta)
        weights.append(U[0] ** 2)
    return np.array(nodes), np.array(weights)


def density(t: np.ndarray, nodes: np.ndarray, weights: np.ndarray, sigma: float) -> np.ndarray:
    """The quadrature's nodes smoothed by Gaussians of width ``sigma``, averaged."""
    kernel = np.exp(-((t[:, None, None] - nodes) ** 2) / (2 * sigma**2))
    return (kernel * weights).sum(axis=2).mean(axis=1) / (sigma * np.sqrt(2 * np.pi))


start = time.perf_counter()
nodes, weights = slq(H.to_scipy().matmat, n, steps=80, vectors=8)
print(f"stochastic Lanczos quadrature: 8 × 80 products ({time.perf_counter() - start:.1f} s)")
print(f"largest Ritz value {nodes.max():.6f}, smallest {nodes.min():.6f}")

# %%
# The largest and smallest Ritz values match ``eigsh``'s extreme eigenvalues: they are the
# first ones Lanczos finds. Most of the mass sits at zero, as in trained and untrained
# networks alike; at random initialisation the outliers lie on both sides (the Hessian of a
# network is indefinite, unlike its Gauss–Newton part).

span = nodes.max() - nodes.min()
t = np.linspace(nodes.min() - 0.05 * span, nodes.max() + 0.05 * span, 2000)
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.semilogy(t, density(t, nodes, weights, sigma=0.01 * span), color="C0",
            label="density (SLQ, 8 vectors × 80 steps)")
for k, value in enumerate(top):
    ax.axvline(value, color="C3", lw=0.8, ls="--", label="top 4 (eigsh)" if k == 0 else None)
ax.axvline(bottom, color="C2", lw=0.8, ls="--", label="smallest (eigsh)")
ax.set_ylim(1e-6, None)
ax.set_xlabel("eigenvalue")
ax.set_ylabel("spectral density")
ax.set_title(f"Loss Hessian of a 2-layer GPT-2 ({n} parameters)")
ax.legend(loc="upper left", fontsize="small")
fig.tight_layout()

# %%
# Against autograd
# ----------------
#
# The same solver on Hessian-vector products by reverse-over-reverse autograd (the
# gradient with ``create_graph=True``, then the gradient of its inner product with ``v``),
# through ``torch.func.functional_call`` over a flat parameter vector. The attention runs
# in PyTorch's math kernel: the default CPU kernel has no second derivative.

names = [name for name, _ in model.named_parameters()]  # the order curvgap uses
shapes = [p.shape for p in model.parameters()]
w0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def autograd_loss(w: torch.Tensor) -> torch.Tensor:
    params = dict(zip(names, (piece.reshape(shape) for piece, shape in
                              zip(w.split([s.numel() for s in shapes]), shapes))))
    logits = torch.func.functional_call(model, params, (X,), {"use_cache": False}).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size),
                                             T.reshape(-1))


def autograd_hvp(v: np.ndarray) -> np.ndarray:
    w = w0.clone().requires_grad_(True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        (g,) = torch.autograd.grad(autograd_loss(w), w, create_graph=True)
        (Hv,) = torch.autograd.grad(g @ torch.as_tensor(v.reshape(-1)), w)
    return Hv.numpy()


reference = LinearOperator((n, n), matvec=autograd_hvp, dtype=np.float64)
start = time.perf_counter()
top_autograd = eigsh(reference, k=1, which="LA", v0=v0, tol=1e-10,
                     return_eigenvectors=False)[0]
print(f"top eigenvalue, autograd: {top_autograd:.12f} ({time.perf_counter() - start:.1f} s)")
print(f"top eigenvalue, curvgap:  {top[0]:.12f}")
print(f"relative difference: {abs(top[0] - top_autograd) / abs(top_autograd):.1e}")

v = np.random.default_rng(1).standard_normal(n)
exact, double_backward = H.to_scipy() @ v, autograd_hvp(v)
print(f"one product, relative difference: "
      f"{np.abs(exact - double_backward).max() / np.abs(double_backward).max():.1e}")
