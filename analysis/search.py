"""Worst cases of the paper's bounds: the smallest ``bound/true`` a search finds.

Random instances (:func:`.bounds.random_instance`) rarely reach the regimes where a bound is
tightest. Here an instance is ``(seed, dims, scales)``: standard normal draws from ``seed``
(``G_W`` per weight, ``G_X``, ``G_T`` and row offsets ``m ∈ R^L``), scaled as

    W = e^{s_W} G_W (each weight its own scale),
    X = e^{s_x} (G_X + e^{s_c} m 1_dᵀ),   T = e^{s_t} G_T,

so that the search can make weight norms very unequal, attention uniform (small
``s_Q + s_K``) or saturated (large), the FFN tiny or huge, and the rows before the first
LayerNorm nearly constant (large ``s_c``). The search minimises, for every bound, the
ratio over the scales: random restarts (random sizes as in the sampling, scales uniform
in :data:`BOX`, plus the corners of the regimes above) and then, per bound, Nelder–Mead on
``log(bound/true)`` over the scales from its best restart. True values come from the
generated modules (dense norms at these sizes), as in :mod:`.bounds`; every instance
evaluated counts for every bound. A true value below ``1e-10`` of the instance's largest
is rounding of a zero and is left out.

A wide search (``wide=True``) does the same for ``M`` and ``M_tr`` alone at larger sizes
(:data:`WIDE`, up to a few thousand parameters), where ``‖H_i‖₂`` comes from Lanczos on the
generated ``hvp`` (:func:`.spectra.hessian_norm`) and no dense Hessian is formed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..generated.torch import paper_block, self_attention
from . import bounds

#: The log-scales searched, and their ranges: per weight, the input, the rows' offsets and
#: the target.
BOX = {"s_Q": (-5.0, 3.0), "s_K": (-5.0, 3.0), "s_V": (-5.0, 3.0), "s_1": (-5.0, 3.0),
       "s_2": (-5.0, 3.0), "s_x": (-4.0, 3.0), "s_c": (-6.0, 4.0), "s_t": (-4.0, 3.0)}
#: Starts at the corners of the regimes (the rest of the scales at 0).
CORNERS = [{"s_Q": -5.0, "s_K": -5.0},                      # uniform attention
           {"s_Q": 3.0, "s_K": 3.0, "s_x": 1.0},            # saturated attention
           {"s_c": 4.0},                                    # nearly constant rows
           {"s_1": -5.0, "s_2": -5.0}, {"s_1": 3.0, "s_2": 3.0},  # tiny, huge FFN
           {"s_Q": 3.0, "s_K": -5.0, "s_V": 3.0},           # very unequal weight norms
           {"s_t": 3.0}, {"s_t": -4.0}]                     # far and near targets
#: The sizes of the wide search, ``(low, high)`` per dimension.
WIDE = {"L": (16, 40), "d": (16, 32), "d_k": (4, 16), "d_ff": (16, 48)}
#: Relative floor below which a true value is rounding of a zero.
FLOOR = 1e-10
#: A ratio this close below 1 is an equality up to rounding (``‖Y‖ = √(L d)`` when every
#: row of ``Y`` is the same), not a violation.
EQUALITY = 1e-9


@dataclass(frozen=True)
class Spec:
    """A reproducible instance: its seed, sizes and log-scales; ``wide``: only ``M`` or
    ``M_tr`` is evaluated (see :func:`checks`)."""

    block: bool
    seed: int
    dims: dict[str, int]
    scales: dict[str, float]
    wide: bool = False

    def as_dict(self) -> dict:
        return {"block": self.block, "seed": self.seed, **self.dims,
                **{k: round(v, 6) for k, v in self.scales.items()},
                **({"wide": True} if self.wide else {})}


def names(block: bool) -> list[str]:
    """The scales of an instance (the FFN's only for the block)."""
    return [k for k in BOX if block or k not in ("s_1", "s_2")]


def instance(spec: Spec) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(params, X, T)`` of ``spec`` (one sample, float64)."""
    module = paper_block if spec.block else self_attention
    gen = torch.Generator().manual_seed(spec.seed)
    dims, s = spec.dims, spec.scales

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    params = {name: math.exp(s[f"s_{name[2:]}"]) * draw(*(dims[a] for a in shape))
              for name, shape in module.PARAMS}
    noise, offsets, target = draw(dims["L"], dims["d"]), draw(dims["L"], 1), \
        draw(dims["L"], dims["d"])
    X = math.exp(s["s_x"]) * (noise + math.exp(s["s_c"]) * offsets)
    return params, X, math.exp(s["s_t"]) * target


def checks(spec: Spec) -> list[bounds.Check]:
    """Every bound at ``spec`` (Theorem 1 for self-attention; Theorem 6, both ``σ_min``
    readings, and the ingredients for the block; for a ``wide`` spec ``M`` and ``M_tr``
    only, ``‖H_i‖₂`` by Lanczos above the dense limit), true values above the floor; none
    where the instance cannot be evaluated (a norm that overflows)."""
    params, X, T = instance(spec)
    try:
        if spec.wide:
            found = (bounds.theorem6(params, X, T, per_block=False) if spec.block
                     else bounds.theorem1(params, X, T, per_block=False))
        else:
            found = (bounds.theorem6(params, X, T) + bounds.ingredients(params, X)
                     if spec.block else bounds.theorem1(params, X, T))
    except (FloatingPointError, ValueError, torch.linalg.LinAlgError):
        return []
    found = [c for c in found if math.isfinite(c.bound) and math.isfinite(c.true)]
    top = max((c.true for c in found), default=0.0)
    return [c for c in found if c.true > FLOOR * top]


@dataclass
class Worst:
    """The smallest ``bound/true`` found for one bound, where, and how hard it was looked
    for (instances evaluated)."""

    theorem: str
    quantity: str
    ratio: float
    bound: float
    true: float
    spec: Spec
    evaluations: int = 0

    @property
    def violated(self) -> bool:
        return self.ratio < 1 - EQUALITY

    def as_dict(self) -> dict:
        return {"theorem": self.theorem, "quantity": self.quantity, "ratio": self.ratio,
                "violated": self.violated, "bound": self.bound, "true": self.true,
                "instance": self.spec.as_dict(), "evaluations": self.evaluations}


@dataclass
class Search:
    """Every bound's worst case so far, for instances of one kind (``block`` or not)."""

    block: bool
    worst: dict[tuple[str, str], Worst] = field(default_factory=dict)
    evaluations: int = 0

    def evaluate(self, spec: Spec) -> list[bounds.Check]:
        found = checks(spec)
        self.evaluations += 1
        for c in found:
            key = (c.theorem, c.quantity)
            best = self.worst.get(key)
            if best is None:
                best = self.worst[key] = Worst(c.theorem, c.quantity, c.ratio, c.bound,
                                               c.true, spec)
            elif c.ratio < best.ratio:
                best.ratio, best.bound, best.true, best.spec = c.ratio, c.bound, c.true, spec
            best.evaluations += 1
        return found


def random_spec(block: bool, seed: int, scales: dict[str, float] | None = None,
                wide: bool = False) -> Spec:
    """Sizes as :func:`.bounds.random_instance` draws them (``wide``: uniform in
    :data:`WIDE`); scales from ``scales`` (the rest 0) or, without it, uniform in
    :data:`BOX`."""
    rng = random.Random(seed)
    if wide:
        dims = {k: rng.randint(*WIDE[k]) for k in WIDE}
    else:
        dims = {"L": rng.randint(2, 24), "d": rng.randint(3 if block else 2, 5),
                "d_k": rng.randint(1, 4), "d_ff": rng.randint(2, 6)}
    if scales is None:
        chosen = {k: rng.uniform(*BOX[k]) for k in names(block)}
    else:
        chosen = {k: scales.get(k, 0.0) for k in names(block)}
    return Spec(block, seed, dims, chosen, wide)


def _local(search: Search, key: tuple[str, str], evaluations: int) -> None:
    """Nelder–Mead on ``log(bound/true)`` of one bound over the scales of its worst
    instance (seed and sizes held), at most ``evaluations`` instances."""
    from scipy.optimize import minimize

    start = search.worst[key].spec
    order = names(start.block)
    low = np.array([BOX[k][0] for k in order])
    high = np.array([BOX[k][1] for k in order])

    def objective(point: np.ndarray) -> float:
        clipped = np.clip(point, low, high)
        spec = Spec(start.block, start.seed, start.dims,
                    {k: float(v) for k, v in zip(order, clipped)}, start.wide)
        ratio = next((c.ratio for c in search.evaluate(spec)
                      if (c.theorem, c.quantity) == key), None)
        penalty = float(np.sum((point - clipped) ** 2))  # stay inside the box
        return (math.log(ratio) if ratio is not None else 50.0) + penalty

    first = np.array([start.scales[k] for k in order])
    minimize(objective, first, method="Nelder-Mead",
             options={"maxfev": evaluations, "initial_simplex": first + np.vstack(
                 [np.zeros(len(order)), 1.5 * np.eye(len(order))])})


def search(block: bool, restarts: int, local_evaluations: int, local_bounds: int | None = None,
           progress: Callable[[str], None] = print, wide: bool = False) -> Search:
    """The worst case of every bound over ``restarts`` random starts and the regime
    corners (each on a random size), then ``local_evaluations`` Nelder–Mead instances per
    bound, for the ``local_bounds`` bounds with the smallest ratios (all by default);
    ``wide``: ``M`` or ``M_tr`` at the sizes of :data:`WIDE`."""
    found = Search(block)
    first = 30_000 if wide else 10_000
    for n, scales in enumerate(CORNERS):
        found.evaluate(random_spec(block, first + n, scales, wide))
    for seed in range(restarts):
        found.evaluate(random_spec(block, first + 10_000 + seed, wide=wide))
    kind = ("block" if block else "self-attention") + (", wide" if wide else "")
    progress(f"  search ({kind}): {found.evaluations} starts, {len(found.worst)} bounds")
    keys = sorted(found.worst, key=lambda k: found.worst[k].ratio)
    for n, key in enumerate(keys[:local_bounds], 1):
        _local(found, key, local_evaluations)
        if n % 10 == 0 or n == len(keys[:local_bounds]):
            progress(f"  search ({kind}): local search {n}/{len(keys[:local_bounds])} bounds, "
                     f"{found.evaluations} instances")
    return found
