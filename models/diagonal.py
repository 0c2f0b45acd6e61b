"""The diagonal of a chain's loss Hessian in bounded memory (:meth:`Chain.diagonal
<curvgap.models.chain.Chain.diagonal>`), never forming a block over parameters.

With ``M_k`` the curvature at part ``k``'s output (per sample) and ``S_j`` part ``j``'s own
input Hessian against its cotangent (the top part's against the loss), the chain rule gives
``M_{k-1} = S_k + J_X^T M_k J_X`` and, per part ``k``,

    diag H(θ_k, θ_k) = diag(part k's own, against g_k) + mean_b diag(J_θ^T M_k J_θ).

The **dense** route carries ``M_k`` down (``B n_Z²`` numbers at once). The **chunked** route
never forms it: unrolled, ``M_k = Σ_{j>k} Q_{jk}^T S_j Q_{jk}`` with ``Q_{jk} = ∂Z_{j-1}/∂Z_k``,
so with ``Q = ∂Z_{j-1}/∂θ_k`` and ``S = Σ_c S e_c e_c^T``

    diag(Q^T S Q) = Σ_c (Q^T S e_c) ∘ (Q^T e_c):

per sample, columns ``e_c`` of the identity at the input of each source part ``j`` go in chunks
through its second derivative (``S e_c``), and each pair ``(S e_c, e_c)`` down the parts below
it by transposed Jacobians (per sample), the products of the pair's parameter cotangents summed.
The Gauss–Newton part has only the top part's ``S``. Each part's own diagonal is taken a few
rows of a parameter at a time. The chunks and the rows are as many as the budget holds
(:func:`most_that_fit`, measured by :func:`~curvgap.models.memory.peak_bytes`); what a call did
is a :class:`DiagonalCost`. What a call will cost is estimated from its first chunks and
said before the rest runs; past ``max_seconds`` it stops there and names the cheaper routes.

The columns are what an exact diagonal from products with ``M`` needs: after fewer than
``n`` products ``M v_i`` (``M`` symmetric ``n × n``) there is a ``u ≠ 0`` orthogonal to every
``v_i``, and ``M + u u^T`` agrees with every product but not on the diagonal. So per sample
and source part, ``n_Z`` columns, each a pass down the parts below, unless ``M`` has a
structure the products use (low rank, or a sparsity the columns can be coloured by; the
attention in every block couples all positions, so ``M`` has neither in general)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..codegen.cache import say
from ..data.ranks import current
from .arrays import ARRAYS, Array
from .hessian import Point
from .memory import check_room, peak_bytes, size_text

#: The default bound, in bytes, on what :meth:`Chain.diagonal` holds at once (2 GiB).
DIAGONAL_MEMORY = 2 * 1024 ** 3


@dataclass
class DiagonalCost:
    """What one :meth:`Chain.diagonal` call did. ``route`` is ``"dense"`` (``M_k`` formed
    per sample) or ``"chunked"``; for the chunked route, ``width`` columns went down
    together, ``chunks`` chunks of ``2·width`` columns of the identity (``columns`` of them
    in all, over every sample and source part) were taken, and ``passes`` counts, by kind
    (``"jvp"``, ``"hvp"``, ``"gnvp"``, ``"vjp"``), the passes of one column through one
    part; the parts' own diagonals took ``slices`` calls of a few rows of a parameter on one
    sample each. ``dense_bytes`` is what the dense route holds (it is taken when that fits
    the budget). ``estimated_seconds`` and ``estimated_bytes`` are what was estimated
    before most of the work (the time from the first chunk of each source part and the first
    slice of each parameter's own diagonal, or the dense route's top part's step, plus the
    planning before them); ``seconds`` is what the call took."""

    route: str
    samples: int
    depth: int
    width: int = 0
    chunks: int = 0
    columns: int = 0
    passes: dict[str, int] = field(default_factory=dict)
    slices: int = 0
    dense_bytes: int = 0
    estimated_seconds: float = 0.0
    estimated_bytes: int = 0
    seconds: float = 0.0

    def add(self, kind: str, part: int, count: int) -> None:
        """Count ``count`` columns' passes of ``kind`` through part ``part``."""
        self.passes[kind] = self.passes.get(kind, 0) + count

    @property
    def backward_equivalents(self) -> float:
        """The passes in whole-model backward passes of one sample (one pass through every
        part, ``depth`` passes of a column through one part), per sample."""
        return sum(self.passes.values()) / self.depth / max(self.samples, 1)


def bounds(max_memory: Any, chunk: Any, max_seconds: Any = None) -> int:
    """``max_memory``, ``chunk`` and ``max_seconds`` checked: the budget in bytes (default
    :data:`DIAGONAL_MEMORY`)."""
    if max_seconds is not None and (isinstance(max_seconds, bool)
                                    or not isinstance(max_seconds, int | float)
                                    or not 0 < max_seconds < float("inf")):
        raise ValueError(f"max_seconds: expected a finite number of seconds > 0 (such as 600) "
                         f"or None (no limit), got {max_seconds!r}")
    if max_memory is None:
        budget = DIAGONAL_MEMORY
    elif isinstance(max_memory, bool) or not isinstance(max_memory, int | float) \
            or not 1 <= max_memory < float("inf"):
        raise ValueError(f"max_memory: expected a finite number of bytes >= 1 (such as 2**31) "
                         f"or None (the default, {DIAGONAL_MEMORY} bytes), got {max_memory!r}")
    else:
        budget = int(max_memory)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1):
        raise ValueError(f"chunk: expected a positive int (columns per chunk) or None "
                         f"(as many as max_memory holds), got {chunk!r}")
    return budget


def most_that_fit(held: Callable[[int], int], one: int, most: int, budget: int) -> int:
    """The most units (columns of a chunk, rows of a slice), up to ``most``, whose work
    ``held(units)`` (bytes; ``one`` at one unit, which fits) stays within ``budget``. It is
    measured at 1, 2, 4, … units while the line through the last two measures (at first the
    line through zero and ``one``) says the next fits, then the count is read off the line
    through the last two, or through the last that fits and the first that does not. The
    work grows faster than linearly at few units (a cheaper phase of it holds the most
    there), so the lines to trust are those through measures at many units."""
    low, low_bytes, units, bytes_held = 0, 0, 1, one
    slope = float(one)
    while units < most:
        slope = (bytes_held - low_bytes) / (units - low)
        wider = min(most, 2 * units)
        if bytes_held + (wider - units) * slope > budget:
            break
        wider_bytes = held(wider)
        if wider_bytes > budget:
            slope = (wider_bytes - bytes_held) / (wider - units)
            return int(min(wider - 1, units + (budget - bytes_held) // max(slope, 1)))
        low, low_bytes, units, bytes_held = units, bytes_held, wider, wider_bytes
    return int(min(most, units + (budget - bytes_held) // max(slope, 1)))


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads a duration (``"45 s"``, ``"3.2 min"``, ``"1.5 h"``)."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.2g} min" if seconds < 5400 else f"{seconds / 3600:.2g} h"


@dataclass
class _Timed:
    """The chunked route's pieces, timed on the first sample: per source part ``j`` its
    chunks per sample (``chunks[j]``), one chunk's second derivative (``source[j]``) and its
    passes down through each part ``k`` below (``down[j][k]``); per part, the seconds of its
    own diagonal over the batch (``own[k]``)."""

    samples: int
    chunks: dict[int, int] = field(default_factory=dict)
    source: dict[int, float] = field(default_factory=dict)
    down: dict[int, dict[int, float]] = field(default_factory=dict)
    own: dict[int, float] = field(default_factory=dict)

    def seconds(self, lowest: int, sources: list[int]) -> float:
        """The call's time over the parts from ``lowest`` up with these ``sources``."""
        total = sum(t for k, t in self.own.items() if k >= lowest)
        for j in sources:
            per_chunk = self.source[j] + sum(t for k, t in self.down[j].items() if k >= lowest)
            total += self.samples * self.chunks[j] * per_chunk
        return total


def _progress(total: int, what: str) -> tqdm:
    """A progress bar over ``total`` steps, as the passes over datasets show them: on a
    terminal after a second, on rank 0 only (``TQDM_DISABLE=1`` turns it off)."""
    here = current()
    return tqdm(total=total, desc=f"curvgap {what}", unit="chunk", leave=False, delay=1.0,
                disable=True if here is not None and here[0] != 0 else None)


class BoundedDiagonal:
    """The diagonal sweeps over the parts' generated ``modules`` (part prefixes
    ``prefixes``, arrays of ``backend``); :attr:`cost` is what the last call did."""

    def __init__(self, modules: list[ModuleType], prefixes: list[str], backend: str) -> None:
        self.modules, self.prefixes, self.backend = modules, prefixes, backend
        self.arrays = ARRAYS[backend]
        self.depth = len(modules)
        #: what the last call cost (None before one)
        self.cost: DiagonalCost | None = None
        self._started = 0.0  # when the current call started (perf_counter)
        self._spent = 0.0  # the seconds of its pieces that an estimate counts already

    def __call__(self, at: Point, budget: int, chunk: int | None,
                 max_seconds: float | None = None) -> tuple[list, Array | None]:
        """The dense route where it fits ``budget`` bytes (and no ``chunk`` is given), else
        the chunked one: per part its diagonal (or None), and per sample the input's
        diagonal (or None). Past ``max_seconds`` (estimated from the first chunks), a
        ``TimeoutError`` before the rest of the work; the dense route over one part is a single
        step, so with ``max_seconds`` that part takes the chunked route (its first slices
        give the estimate)."""
        self._started, self._spent = time.perf_counter(), 0.0
        dense = self._dense_bytes(at)
        one_step = at.lowest == self.depth - 1
        if chunk is None and dense <= budget and (max_seconds is None or not one_step) \
                and not at.shared:
            check_room(dense, self.arrays.device(at.inputs[0]),
                       f"diagonal: the dense route that max_memory ({budget} bytes) allows",
                       "a max_memory below the memory at hand (default 2 GiB: the columns "
                       "go through the model in chunks)")
            self.cost = DiagonalCost("dense", at.inputs[0].shape[0], self.depth,
                                     estimated_bytes=dense)
            pieces, diag_X = self._dense(at, max_seconds)
        else:
            pieces, diag_X = self._chunked(at, budget, chunk, max_seconds)
        self.cost.dense_bytes = dense
        self.cost.seconds = time.perf_counter() - self._started
        return pieces, diag_X

    def _estimated(self, at: Point, seconds: float, max_seconds: float | None, how: str,
                   cheaper: str = "") -> None:
        """Say the estimate of the call, ``seconds`` (from what ``how`` names; the planning so
        far is added), where it is long, and stop past ``max_seconds``, naming the ``cheaper``
        routes."""
        cost = self.cost
        seconds += self._planning()
        cost.estimated_seconds = seconds
        entries = (cost.samples * at.sizes[0] if at.to_input else
                   sum(int(np.prod(at.layers[k][name].shape))
                       for k in range(self.depth) for name in at.chosen[k]
                       if all(other < (k, name) for other in at.shared.get((k, name), ()))))
        what = (f"the exact diagonal of {entries} entries takes about {_duration(seconds)} "
                f"here ({how}), holding about {size_text(cost.estimated_bytes)}")
        if max_seconds is not None and seconds > max_seconds:
            raise TimeoutError(
                f"max_seconds: expected the diagonal within {max_seconds:g} s, got an "
                f"estimate over it: {what}; nothing more was done. Cheaper: {cheaper}"
                f"Hutchinson's estimate (the mean of z ⊙ Hz over N random ±1 vectors z: "
                f"hvp with an (n, N) matrix, or curvlinops' hutchinson_diag on "
                f"hessian_operator), whose error falls as 1/√N; or a larger max_seconds")
        if seconds >= 5:
            say(what)

    def _planning(self) -> float:
        """The seconds since the call started, less the pieces already in the estimate."""
        return time.perf_counter() - self._started - self._spent

    def _sample(self, k: int, layer: dict[str, Array], b: int, copies: int) -> dict:
        """Part ``k``'s parameters and constants for ``copies`` copies of sample ``b`` (the
        constants with a batch axis, ``_BATCHED``, taken at ``b`` and repeated)."""
        batched = getattr(self.modules[k], "_BATCHED", ())
        return {name: self.arrays.tile(value[b:b + 1], copies) if name in batched else value
                for name, value in layer.items()}

    def _dense_bytes(self, at: Point) -> int:
        """What the dense route holds at its largest, in bytes: per part the curvature ``M``,
        its input Jacobian and the next ``M`` (``3 B n_Z²``) and the parameter Jacobian with
        its product (``2 B n_Z n_θ``), or the tangents of the part's own diagonal of a
        parameter whole (all its rows at once), if more."""
        layers, inputs = at.layers, at.inputs
        batch, largest, own = inputs[0].shape[0], 0, 0
        for k in range(at.lowest, self.depth):
            outputs = (int(np.prod(inputs[k + 1].shape[1:])) if k + 1 < self.depth else
                       int(np.prod(self.modules[k].forward(
                           self._sample(k, layers[k], 0, 1),
                           inputs[k][:1]).shape[1:])))
            n_in = int(np.prod(inputs[k].shape[1:]))
            n_theta = sum(int(np.prod(layers[k][name].shape)) for name in at.chosen[k])
            largest = max(largest, 2 * outputs ** 2 + n_in ** 2 + 2 * outputs * n_theta)
            for name in at.chosen[k]:
                rows, _, held = self.modules[k].diagonal_row_layout(layers[k], inputs[k], name)
                own = max(own, rows * held)
        return max(batch * largest, own) * self.arrays.itemsize(inputs[0])

    def _dense(self, at: Point, max_seconds: float | None) -> tuple[list, Array | None]:
        """The dense route: ``M_k`` per sample carried down as in :meth:`Chain.loss_hessian`;
        its time estimated from the top part's step (the parts below repeat it)."""
        pieces, M = [None] * self.depth, None
        layers, inputs, cost = at.layers, at.inputs, self.cost
        batch = inputs[0].shape[0]
        top = self.depth - 1
        for k in range(top, at.lowest - 1, -1):
            step = time.perf_counter()
            module, names = self.modules[k], at.chosen[k]
            args = (layers[k], inputs[k], at.against(k))
            if names:
                pieces[k] = module.diagonal(*args, wrt=names, part=at.part)
                if M is not None:
                    J_t = self.arrays.cat([module.jacobian(layers[k], inputs[k], name)
                                           for name in names], -1)
                    pieces[k] = pieces[k] + ((M @ J_t) * J_t).sum(axis=(0, 1)) / batch
            if k > at.lowest or at.to_input:
                J_X = module.jacobian(layers[k], inputs[k], "X")
                H_XX = module.loss_hessian(*args, wrt="X", part=at.part)
                M = H_XX if M is None else H_XX + J_X.swapaxes(1, 2) @ (M @ J_X)
            if k == top and k > at.lowest:
                self._estimated(at, (time.perf_counter() - step) * (top - at.lowest),
                                max_seconds, f"dense route over {cost.samples} sample(s), "
                                f"estimated from its top part's step")
        if not at.to_input:
            return pieces, None
        return pieces, (M * self.arrays.eye(M.shape[-1], M)).sum(-1)

    def _chunked(self, at: Point, budget: int, chunk: int | None,
                 max_seconds: float | None) -> tuple[list, Array | None]:
        """The chunked route; :attr:`cost` records its sweeps. The parts' own diagonals are
        planned first (their slices checked against ``budget``) and sample 0's first chunk
        of each source runs before the others: from their times the call's is estimated."""
        top, batch = self.depth - 1, at.inputs[0].shape[0]
        # the parts whose input Hessian is a source: every part above the lowest one asked
        # for (and the lowest too for the input); the Gauss–Newton part has only the top's
        sources = [j for j in range(top, at.bottom - 1, -1) if j > at.lowest or at.to_input]
        if at.part == "gauss_newton":
            sources = sources[:1] if sources and sources[0] == top else []
        chunk, held = self._chunk_width(at, sources, budget, chunk) if sources else (1, 0)
        cost = DiagonalCost("chunked", batch, self.depth, chunk)
        self.cost = cost
        how = (f"chunked route: {batch * sum(at.sizes[j] for j in sources)} columns over "
               f"{batch} sample(s) in chunks of {2 * chunk}, then the parts' own diagonals; "
               f"estimated from the first chunk of each source part and the first slice of "
               f"each parameter")
        timed = _Timed(batch, {j: -(-at.sizes[j] // (2 * chunk)) for j in sources})
        plans = {k: self._own_plan(at, k, budget, timed) for k in range(at.lowest, self.depth)
                 if at.chosen[k]}
        cost.estimated_bytes = max([held] + [p[4] for plan in plans.values() for p in plan])
        totals = [[None] * len(names) for names in at.chosen]  # Σ over samples, by name
        diag_X = []
        steps = batch * sum(timed.chunks.values())
        with _progress(steps, "diagonal") as bar:
            for b in range(batch if sources else 0):
                saved = self._tiled_saved(at, b, 2 * chunk)
                tiled = self._tiled_targets(at, b, 2 * chunk, sources)
                value_X = None
                # on sample 0 the first chunk of each source first (timed); else source by
                # source, so that no source's tangents stay while others pass through it
                order = [(j, start) for j in sources
                         for start in range(2 * chunk if b == 0 else 0, at.sizes[j], 2 * chunk)]
                order = [(j, 0) for j in sources] + order if b == 0 else order
                for i, (j, start) in enumerate(order):
                    clock = timed if b == 0 and start == 0 else None
                    value_X = self._source_chunk(at, saved, tiled, j, start, 2 * chunk,
                                                 totals, value_X, cost, clock)
                    bar.update(1)
                    if b == 0 and i == len(sources) - 1:
                        # a source's tangents would stay while the chunks of the sources
                        # above it pass down through it: the forward values made again
                        # (and none held by a refusal's traceback)
                        saved = None
                        try:
                            self._estimated(at, timed.seconds(at.bottom, sources),
                                            max_seconds, how, self._cheaper(at, timed, sources))
                        except TimeoutError:
                            tiled = None
                            raise
                        saved = self._tiled_saved(at, b, 2 * chunk)
                if at.to_input:
                    diag_X.append(value_X)
                saved = tiled = None  # freed before the next sample's copies are made
        if not sources:
            self._estimated(at, timed.seconds(at.bottom, []), max_seconds, how)
        pieces: list = [None] * self.depth
        for k, plan in plans.items():
            own = self._own(at, k, plan, cost)
            pieces[k] = self.arrays.cat([
                value if totals[k][i] is None else value + totals[k][i].reshape(-1) / batch
                for i, value in enumerate(own)])
        return pieces, self.arrays.stack(diag_X) if at.to_input else None

    def _cheaper(self, at: Point, timed: _Timed, sources: list[int]) -> str:
        """The routes cheaper than this call, with their estimated times, as a phrase."""
        routes, planning = [], self._planning()
        if at.part == "full" and len(sources) > 1:
            gauss_newton = timed.seconds(at.bottom, sources[:1]) + planning
            routes.append(f"part='gauss_newton' (the loss's curvature through the model "
                          f"only, about {_duration(gauss_newton)})")
        if not at.to_input and not at.shared:  # (a tied weight's places are asked together)
            for k in range(at.lowest + 1, self.depth):
                if any(at.chosen[i] for i in range(k, self.depth)):
                    higher = timed.seconds(k, [j for j in sources if j > k]) + planning
                    routes.append(f"wrt= the parameters of {self.prefixes[k]} and the parts "
                                  f"above it only (about {_duration(higher)})")
                    break
        return "".join(f"{route}; " for route in routes)

    def _tiled_saved(self, at: Point, b: int, copies: int) -> list:
        """Each part's saved forward call from the bottom part up, on ``copies`` copies of
        sample ``b`` (``None`` below it)."""
        saved: list = [None] * self.depth
        for k in range(at.bottom, self.depth):
            saved[k] = self.modules[k].forward_saved(
                self._sample(k, at.layers[k], b, copies),
                self.arrays.tile(at.inputs[k][b:b + 1], copies))[1]
        return saved

    def _tiled_targets(self, at: Point, b: int, copies: int, sources: list[int]
                       ) -> dict[int, Array]:
        """What each source part's second derivative is taken against, ``copies`` copies of
        sample ``b``'s."""
        return {j: self.arrays.tile(at.against(j)[b:b + 1], copies) for j in sources}

    def _source_chunk(self, at: Point, saved: list, tiled: dict[int, Array], j: int,
                      start: int, width: int, totals: list[list], value_X: Array | None,
                      cost: DiagonalCost, clock: _Timed | None = None) -> Array | None:
        """One chunk of ``width`` columns of the identity at the input of source part ``j``
        (from column ``start``): ``S E`` by part ``j``'s per-sample input products, then the
        pairs ``(S e_c, e_c)``, half the chunk at a time, down to the bottom part, adding
        ``Σ_c (J^T S e_c) ∘ (J^T e_c)`` into ``totals`` (per part and parameter) and into
        the input's diagonal, which is returned (None while nothing has reached it).
        ``clock``: its pieces' seconds recorded there."""
        module = self.modules[j]
        shape = tuple(at.inputs[j].shape[1:])
        ticked = time.perf_counter()
        E = self.arrays.unit(at.sizes[j], start, width, at.inputs[j])
        module.jvp_saved(saved[j], None, E.reshape(width, *shape))
        # each column's own products in part j's parameters, where a tie needs them
        crossed = any(k < j for (i, _), others in at.shared.items() if i == j
                      for k, _ in others)
        mixed = None
        if at.part == "gauss_newton":
            if crossed:
                mixed, SE = module.gnvp_per_sample_saved(saved[j], tiled[j])
            else:
                SE = module.gnvp_saved(saved[j], tiled[j])[1]
            cost.add("gnvp", j, width)
        else:
            if crossed:
                mixed, SE = module.hvp_per_sample_saved(saved[j], tiled[j])
            else:
                SE = module.hvp_saved(saved[j], tiled[j], None)[1]
            cost.add("hvp", j, width)
        cost.add("jvp", j, width)
        cost.columns += min(width, at.sizes[j] - start)
        cost.chunks += 1
        if clock is not None:
            clock.source[j], clock.down[j] = time.perf_counter() - ticked, {}
            self._spent += clock.source[j]
        half = width // 2
        for h in range(2):
            # the pairs (S e_c, e_c) of this half as one batch: S e_c first, e_c after
            down = self.arrays.cat([SE[h * half:(h + 1) * half],
                                    E[h * half:(h + 1) * half].reshape(half, *shape)])
            held = {}  # a tied parameter's places below j: (J^T S e_c, J^T e_c) per column
            for k in range(j - 1, at.bottom - 1, -1):
                ticked = time.perf_counter()
                if at.chosen[k]:
                    grads, down = self.modules[k].vjp_per_sample_saved(saved[k], down)
                    for name in at.chosen[k]:
                        flat = grads[name].reshape(2 * half, -1)
                        _add(totals, at, (k, name), (flat[:half] * flat[half:]).sum(0))
                        if (k, name) in at.shared:  # in its group's first place's layout
                            index = at.homes[k, name][1]
                            held[k, name] = ((flat[:half], flat[half:]) if index is None else
                                             (flat[:half, index], flat[half:, index]))
                else:
                    down = self.modules[k].vjp_saved(saved[k], down)[1]
                cost.add("vjp", k, 2 * half)
                if clock is not None:
                    clock.down[j][k] = clock.down[j].get(k, 0.0) + time.perf_counter() - ticked
                    self._spent += time.perf_counter() - ticked
            self._crossed(at, j, held, mixed, slice(h * half, (h + 1) * half), totals)
            if at.to_input:  # the pairs have reached X
                flat = down.reshape(2 * half, -1)
                term = (flat[:half] * flat[half:]).sum(0)
                value_X = term if value_X is None else value_X + term
        return value_X

    def _crossed(self, at: Point, j: int, held: dict, mixed: dict | None, columns: slice,
                 totals: list[list]) -> None:
        """The terms between the places of a tied parameter, for the columns ``columns`` of
        source part ``j``'s chunk: for two places ``p ≠ q`` below ``j``,
        ``Σ_c (J_p^T S e_c) ∘ (J_q^T e_c)``; for ``s`` in part ``j`` and
        ``q`` below it, ``Σ_c (∂²f_j/∂θ_s∂X e_c) ∘ (J_q^T e_c)`` twice (its Gauss–Newton part
        for ``part="gauss_newton"``), each in the layout of the group's first place and into
        its total. Summed over the places (each read in that layout), the totals then hold
        every block between them: ``Σ_{p,q} diag(H_pq)``."""
        for place, (S_p, _) in held.items():
            home = at.homes[place][0]
            for other in at.shared[place]:
                if other in held:
                    _add(totals, at, home, (S_p * held[other][1]).sum(0))
                elif other[0] == j:
                    own = mixed[other[1]][columns]
                    own = own.reshape(own.shape[0], -1)
                    index = at.homes[other][1]
                    own = own if index is None else own[:, index]
                    _add(totals, at, home, 2 * (own * held[place][1]).sum(0))

    def _chunk_width(self, at: Point, sources: list[int], budget: int, chunk: int | None
                     ) -> tuple[int, int]:
        """The most columns per chunk whose work fits ``budget`` bytes (or ``chunk``, given),
        and the bytes that work holds (estimated): the most bytes held at once
        (:func:`~curvgap.models.memory.peak_bytes`) by one sample's copies and one chunk of
        each source, measured on the first sample (:func:`most_that_fit`)."""

        def one_sample(width: int) -> None:
            saved = self._tiled_saved(at, 0, 2 * width)
            tiled = self._tiled_targets(at, 0, 2 * width, sources)
            scratch = [[None] * len(names) for names in at.chosen]
            for j in sources:
                self._source_chunk(at, saved, tiled, j, 0, 2 * width, scratch, None,
                                   DiagonalCost("chunked", 1, self.depth))

        measured: dict[int, int] = {}

        def held(width: int) -> int:
            measured[width] = peak_bytes(partial(one_sample, width), self.backend)
            return measured[width]

        if chunk is not None:
            return chunk, held(chunk)
        one = held(1)
        if one > budget:
            raise ValueError(f"max_memory: expected at least {one} bytes (one column's work "
                             f"in the chunked diagonal at these sizes), got {budget}")
        width = most_that_fit(held, one, -(-max(at.sizes[j] for j in sources) // 2), budget)
        return width, _at(measured, width, budget)

    def _own_plan(self, at: Point, k: int, budget: int, timed: _Timed) -> list[tuple]:
        """Part ``k``'s own diagonal planned, per name asked: ``(rows, step, first, seconds,
        bytes)``, as many rows of its first axis at a time (``step``) as fit in ``budget``
        bytes (their work measured on the first sample, :func:`most_that_fit`), the first
        slice's value on sample 0 (``first``) and its time, and the bytes a slice holds;
        ``timed.own[k]`` is the part's whole estimate."""
        module, batch = self.modules[k], at.inputs[k].shape[0]
        X, against = at.inputs[k], at.against(k)
        first = self._sample(k, at.layers[k], 0, 1)
        plan = []
        for name in at.chosen[k]:
            rows = module.diagonal_row_layout(first, X[:1], name)[0]
            measured: dict[int, int] = {}

            def held(stop: int, name: str = name, measured: dict = measured) -> int:
                measured[stop] = peak_bytes(partial(
                    module.diagonal_rows, first, X[:1], against[:1], name, 0, stop, at.part),
                    self.backend)
                return measured[stop]

            one = held(1)
            if one > budget:
                raise ValueError(f"max_memory: expected at least {one} bytes (the work of one "
                                 f"row of {self.prefixes[k]}.{name} for its own diagonal), "
                                 f"got {budget}")
            step = most_that_fit(held, one, rows, budget)
            ticked = time.perf_counter()
            value = module.diagonal_rows(first, X[:1], against[:1], name, 0, step, at.part)
            seconds = time.perf_counter() - ticked
            self._spent += seconds
            plan.append((rows, step, value, seconds, _at(measured, step, budget)))
            timed.own[k] = timed.own.get(k, 0.0) + seconds * batch * -(-rows // step)
        return plan

    def _own(self, at: Point, k: int, plan: list[tuple], cost: DiagonalCost) -> list[Array]:
        """Part ``k``'s own diagonal over its names asked, against its target, averaged over
        the batch, as ``plan``\'s (:meth:`_own_plan`) slices: per name the ``vec_r`` of its
        entries."""
        module, batch = self.modules[k], at.inputs[k].shape[0]
        X, against = at.inputs[k], at.against(k)
        values = []
        for name, (rows, step, first, _, _) in zip(at.chosen[k], plan):
            slices = []
            for start in range(0, rows, step):
                total = None
                for b in range(batch):
                    value = first if start == 0 and b == 0 else module.diagonal_rows(
                        self._sample(k, at.layers[k], b, 1), X[b:b + 1], against[b:b + 1],
                        name, start, min(rows, start + step), at.part)
                    total = value if total is None else total + value
                    cost.slices += 1
                slices.append(total / batch)
            values.append(self.arrays.cat(slices))
        return values


def _add(totals: list[list], at: Point, place: tuple[int, str], term: Array) -> None:
    """``term`` (flat) added into the total of ``place`` (``(part, name)``)."""
    k, i = place[0], at.chosen[place[0]].index(place[1])
    totals[k][i] = term if totals[k][i] is None else totals[k][i] + term


def _at(measured: dict[int, int], units: int, budget: int) -> int:
    """The bytes ``units`` hold, from the measures at other counts (``measured``): the
    largest measure at or below it, scaled to it, within ``budget``."""
    below = max(u for u in measured if u <= units)
    return min(budget, max(measured[below], measured[below] * units // below))
