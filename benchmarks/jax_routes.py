"""The JAX routes of ``curvgap bench --scale`` (``jax[cpu]``, optional): the post-LN block's
forward pass written in ``jax.numpy`` (single-head attention, LayerNorm without affine,
the configured activation, MSE), and ``jit``-compiled Hessian- and Gauss–Newton-vector
products from JAX's own transforms (``jvp`` of ``grad``; ``jvp`` then ``vjp``). Compilation
happens in the warm-up call, not in the timed ones."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._extras import require
from ..derivations.config import Config

#: What the JAX forward pass covers: the paper's block and its activation variants.
SUPPORTED = {"kind": "block", "norm": "layernorm", "norm_position": "post", "heads": 1,
             "causal": False, "out_proj": False, "affine": False, "ffn_bias": False,
             "loss": "mse"}


def unsupported(config: Config) -> str | None:
    """Why the JAX routes cannot run ``config`` (None if they can)."""
    for key, value in SUPPORTED.items():
        if getattr(config, key) != value:
            return f"the JAX forward pass covers {key} = {value!r}, not {getattr(config, key)!r}"
    if config.activation not in ("relu", "gelu", "gelu_tanh", "silu", "tanh"):
        return f"the JAX forward pass has no activation {config.activation!r}"
    return None


def routes(config: Config, params: dict, X, target, v) -> dict[str, Callable]:
    """``{"jax jit hvp": ..., "jax jit ggn": ...}`` on numpy copies of the case (float64)."""
    jax = require("jax", "the JAX comparison")
    jnp = require("jax.numpy", "the JAX comparison")

    jax.config.update("jax_enable_x64", True)
    activation = {"relu": jax.nn.relu, "gelu": lambda u: jax.nn.gelu(u, approximate=False),
                  "gelu_tanh": lambda u: jax.nn.gelu(u, approximate=True),
                  "silu": jax.nn.silu, "tanh": jnp.tanh}[config.activation]
    eps = config.eps
    names = list(params)
    p = {k: jnp.asarray(np.asarray(t)) for k, t in params.items()}
    x, t = jnp.asarray(np.asarray(X)), jnp.asarray(np.asarray(target))
    sizes = [int(np.prod(params[k].shape)) for k in names]
    pieces = np.split(np.asarray(v), np.cumsum(sizes)[:-1])
    u = {k: jnp.asarray(piece.reshape(params[k].shape)) for k, piece in zip(names, pieces)}

    def norm(a):
        c = a - a.mean(-1, keepdims=True)
        return c / jnp.sqrt((c * c).mean(-1, keepdims=True) + eps)

    def output(q):
        scores = x @ q["W_Q"] @ q["W_K"].T @ jnp.swapaxes(x, -1, -2) / np.sqrt(
            q["W_Q"].shape[1])
        y = norm(x + jax.nn.softmax(scores, axis=-1) @ x @ q["W_V"])
        return norm(y + activation(y @ q["W_1"]) @ q["W_2"])

    def loss_of(z):
        return ((z - t) ** 2).sum() / z.size

    def loss(q):
        return loss_of(output(q))

    hvp = jax.jit(lambda q, w: jax.jvp(jax.grad(loss), (q,), (w,))[1])

    def ggn_product(q, w):
        z, dz = jax.jvp(output, (q,), (w,))
        curved = jax.jvp(jax.grad(loss_of), (z,), (dz,))[1]
        return jax.vjp(output, q)[1](curved)[0]

    ggn = jax.jit(ggn_product)

    def flat(result):
        return np.concatenate([np.asarray(result[k]).reshape(-1) for k in names])

    return {"jax jit hvp": lambda: flat(jax.block_until_ready(hvp(p, u))),
            "jax jit ggn": lambda: flat(jax.block_until_ready(ggn(p, u)))}
