"""The exact-diagonal row of ``curvgap bench --models``: a whole language model's exact
Hessian diagonal, what it was estimated to cost before it ran and what it cost, against
autograd's exact diagonal (one double backward per entry) and against Hutchinson's estimate
given the same time.

The model is a 2-layer GPT-2 with its own (untied) head on token ids and the next-token
cross-entropy, float64, one sample, random weights; the double backward is
:class:`~curvgap.benchmarks.model_routes.Routes`'. Hutchinson's
estimate is the mean of ``z ⊙ Hz`` over Rademacher vectors ``z``, its products curvgap's
HVPs in columns of 64, as many columns as take the exact diagonal's time."""

from __future__ import annotations

import time
from typing import Any

import torch

from .model_routes import Model, Routes, relative_error

#: Hutchinson's products per call (the columns of one matrix ``v``)
COLUMNS = 64


def _model(quick: bool, device: str) -> Model:
    from transformers import GPT2Config, GPT2LMHeadModel

    d, L, V, heads = (16, 8, 40, 2) if quick else (64, 32, 512, 4)
    config = GPT2Config(n_embd=d, n_layer=2, n_head=heads, n_positions=L, vocab_size=V,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                        tie_word_embeddings=False)
    generator = torch.Generator().manual_seed(0)
    module = GPT2LMHeadModel(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.02
                    + (1.0 if p.ndim == 1 and "weight" in name else 0.0))
    ids = torch.randint(0, V, (1, L + 1), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    return Model(f"GPT-2 LM, 2 layers, d={d}, L={L}, {V} words, B=1", module.to(device),
                 ids[:, :-1], ids[:, 1:], loss="cross_entropy", inputs={"use_cache": False},
                 curvlinops=False)


def exact_diagonal(quick: bool, device: str = "cpu", peak: Any = None) -> dict:
    """The row: the exact diagonal's time, its estimate, route and peak memory (``peak(fn)``
    in GB, or None), the relative error of 8 entries drawn among all against double backward
    on unit vectors, autograd's exact diagonal at its timed rate (``n`` double backwards),
    and Hutchinson's relative error ``‖d̂ − d‖ / ‖d‖`` after as many products as take the
    same time."""
    model = _model(quick, device)
    routes = Routes(model)
    c, X, T, inputs = routes.curvature, model.X, model.T, model.inputs
    n = routes.v.numel()
    try:  # the first use: reading the module and generating the diagonal's code
        c.diagonal(X, T, max_seconds=1e-9, **inputs)
    except TimeoutError:
        pass
    held: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        held["diagonal"] = c.diagonal(X, T, **inputs)
        held["seconds"] = time.perf_counter() - start

    memory = peak(run) if peak is not None else run()
    exact, seconds, cost = held["diagonal"], held["seconds"], c.diagonal_cost
    product = routes.retained_double_backward()
    entries = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:8]
    start = time.perf_counter()
    reference = torch.stack([product(torch.nn.functional.one_hot(i, n).to(exact))[i]
                             for i in entries])
    double_backward = (time.perf_counter() - start) / len(entries)
    generator = torch.Generator(device=device).manual_seed(3)
    total, products, start = torch.zeros_like(exact), 0, time.perf_counter()
    while products == 0 or time.perf_counter() - start < seconds:
        Z = torch.randint(0, 2, (n, COLUMNS), generator=generator, device=device,
                          dtype=exact.dtype) * 2 - 1
        total += (Z * c.hvp(X, T, Z, **inputs)).sum(1)
        products += COLUMNS
    hutchinson = total / products
    return {"model": model.name, "parameters": n, "route": cost.route, "seconds": seconds,
            "estimated_seconds": cost.estimated_seconds, "peak_memory_gb": memory,
            "relative_error": relative_error(exact[entries], reference),
            "autograd_seconds": n * double_backward,
            "hutchinson_products": products,
            "hutchinson_seconds": time.perf_counter() - start,
            "hutchinson_relative_error": relative_error(hutchinson, exact)}


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def line(row: dict) -> str:
    """The row as the run prints it and the docs show it."""
    memory = "" if row["peak_memory_gb"] is None else f", peak {row['peak_memory_gb']:.2f} GB"
    return (f"Exact diagonal of {row['model']} ({row['parameters']:,} entries, "
            f"{row['route']} route): {_seconds(row['seconds'])} (estimated beforehand: "
            f"{_seconds(row['estimated_seconds'])}){memory}, 8 sampled entries within "
            f"{row['relative_error']:.0e} of double backward; autograd's exact diagonal "
            f"(a double backward per entry) would take about {_seconds(row['autograd_seconds'])} "
            f"({row['autograd_seconds'] / row['seconds']:.0f}×); Hutchinson's estimate in "
            f"the same time ({row['hutchinson_products']:,} HVPs) is off by "
            f"{100 * row['hutchinson_relative_error']:.0f} % (relative error of the whole "
            f"diagonal).")
