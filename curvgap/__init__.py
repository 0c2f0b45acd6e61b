"""curvgap: exact Jacobians, Hessians and Hessian-vector products of Transformer layers.

``curvgap.curvature(module, loss="mse")`` gives them for a PyTorch layer, block or model,
read from what its forward computes, in the module's own parameter order and layout
(:mod:`curvgap.adapters`); the generated modules of the shipped configs are in
``curvgap.generated.numpy`` and ``curvgap.generated.torch``.
"""

from __future__ import annotations

from typing import Any


def curvature(module: Any, loss: str = "mse", fused: bool = False) -> Any:
    """The exact curvature of ``module`` under ``loss``
    (:class:`~curvgap.adapters.Curvature`).

    The first call that needs code the module cache does not hold generates it and says so in
    one line on stderr (what, why, and how long it took); calls served by the cache say
    nothing. Set ``CURVGAP_QUIET=1`` in the environment to silence the line.

    ``fused=True`` runs the generated code through ``torch.compile(fullgraph=True)``: the first
    call for each kind of inputs compiles (about a minute at GPT-2 width on a CPU), later calls
    run fused kernels (the gradient, HVP and Gauss–Newton product 15–40 % faster there)."""
    from .adapters import curvature as make

    return make(module, loss, fused)


def formula_diff(a: Any, b: Any, X: Any = None, labels: tuple[str, str] | None = None,
                 pdf: Any = None, markdown: bool = False, **inputs: Any) -> str:
    """What changes in the formulas from the block ``a`` to the block ``b`` (modules read on
    the input ``X``, or configs), as a LaTeX document (Markdown with ``markdown=True``;
    compiled into ``pdf`` when given): each loss-Hessian block new, gone, changed (and in which
    derivatives) or the same, and the architectures and changed first derivatives side by side
    (:func:`curvgap.adapters.comparison.formula_diff`)."""
    from .adapters.comparison import formula_diff as diff

    return diff(a, b, X, labels, pdf, markdown, **inputs)
