"""Chains of generated modules, ``Z_k = part_k(Z_{k-1}; θ_k)``, ``Z_0 = X``, with the last
part's loss on the output (a :class:`Stack` is ``N`` blocks of one config): the gradient,
Jacobians, the exact loss Hessian over the parameters of every part (and the input) and the
matrix-free HVP, composed from the parts' generated functions by the chain rule, so that one
derivation of a part serves every depth.

Per sample ``b``, with ``g_k = ∂ℓ_b/∂Z_k`` and ``M_k = ∂²ℓ_b/∂Z_k²``, block ``k`` (input
``Z_{k-1}``) gives its Jacobians ``J_X, J_θ`` and, from the module of its config with the
``linear`` loss ``Σ g_k∘Z_k``, the second derivatives contracted with ``g_k``:
``A = Σ g ∂²Z/∂X²``, ``C = Σ g ∂²Z/∂X∂θ``, ``D = Σ g ∂²Z/∂θ²``. Then

    H(X, X) = J_X^T M_k J_X + A            = M_{k-1}
    H(X, θ_k) = J_X^T M_k J_θ + C
    H(θ_k, θ_k) = mean_b J_θ^T M_k J_θ + D
    H(θ_a, θ_k) = mean_b (∂Z_{k-1}/∂θ_a)^T H(X, θ_k),   a < k,

with ``∂Z_{k-1}/∂θ_a = J_X^{(k-1)} ⋯ J_X^{(a+1)} J_θ^{(a)}``, carried down as
``J_X^T H(X, θ_k)`` one block at a time; the top block's three blocks come straight from the
module with the config's own loss. The gradient costs one pass per block, each block row
of the Hessian one pass down the layers below it. Where ``M_k`` has low rank (behind a
cross-entropy head over ``c`` classes, at most ``c − 1`` per sample) it is used as its
eigenfactors, ``M = U diag(λ) U^T``, so the products cost ``r/n`` of the dense ones.

The Hessian-vector product is matrix-free (Pearlmutter's forward-over-reverse, one part at a
time): tangents ``dZ_k = J_X dZ_{k-1} + J_θ v_k`` go up through each part's ``jvp``; the
cotangents' tangents ``dg_{k-1}`` and the products ``(Hv)_k`` come down through each part's
``hvp_joint`` along ``(v_k, dZ_{k-1})`` with its cotangent ``g_k`` as the linear loss's
target and ``dg_k`` as that target's direction (which adds ``J^T dg_k``):

    (dg_{k-1}, (Hv)_k) = (∂²(g_k·Z_k)/∂(X, θ_k)²) (dZ_{k-1}, v_k) + J^T dg_k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..codegen.cache import module_for
from ..data import over_batches
from ..data.ranks import current
from ..derivations.config import Config
from ..derivations.program import Program
from .memory import check_room, peak_bytes

Array = Any  # a torch tensor, or a numpy array for the numpy backend


def _key(prefix: str, name: str) -> str:
    """A part's parameter ``name`` as the chain names it: ``"<prefix>.<name>"`` (just
    ``name`` in a part without a prefix, a chain of one part)."""
    return f"{prefix}.{name}" if prefix else name


def written(array: Array, value: Array) -> None:
    """``value`` (of ``array``'s size) in the 1-D ``array``: copied there unless it is there
    already (a result written into its slice of a flat array)."""
    if isinstance(array, torch.Tensor):
        there = (value.data_ptr() == array.data_ptr() and value.is_contiguous()
                 and value.numel() == array.numel() and value.dtype == array.dtype)
        if not there:
            array.copy_(value.reshape(-1))
    elif not (value.ctypes.data == array.ctypes.data and value.flags.c_contiguous
              and value.size == array.size and value.dtype == array.dtype):
        array[...] = value.reshape(-1)


def overflowed(quantity: str, dtype: Any) -> FloatingPointError:
    """The error for a result with inf or NaN entries although every input was finite."""
    return FloatingPointError(f"{quantity} has entries that are inf or NaN although every "
                              f"input is finite: the arithmetic overflowed {dtype}; pass "
                              "inputs and parameters of smaller magnitude (or float64)")


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
    the budget)."""

    route: str
    samples: int
    depth: int
    width: int = 0
    chunks: int = 0
    columns: int = 0
    passes: dict[str, int] = field(default_factory=dict)
    slices: int = 0
    dense_bytes: int = 0

    def add(self, kind: str, part: int, count: int) -> None:
        """Count ``count`` columns' passes of ``kind`` through part ``part``."""
        self.passes[kind] = self.passes.get(kind, 0) + count

    @property
    def backward_equivalents(self) -> float:
        """The passes in whole-model backward passes of one sample (one pass through every
        part, ``depth`` passes of a column through one part), per sample."""
        return sum(self.passes.values()) / self.depth / max(self.samples, 1)


def _budget(max_memory: Any) -> int:
    """``max_memory`` checked: a positive number of bytes (default :data:`DIAGONAL_MEMORY`)."""
    if max_memory is None:
        return DIAGONAL_MEMORY
    if isinstance(max_memory, bool) or not isinstance(max_memory, int | float) \
            or not 1 <= max_memory < float("inf"):
        raise ValueError(f"max_memory: expected a finite number of bytes >= 1 (such as 2**31) "
                         f"or None (the default, {DIAGONAL_MEMORY} bytes), got {max_memory!r}")
    return int(max_memory)


def _most_that_fit(held: Callable[[int], int], one: int, most: int, budget: int) -> int:
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


def _itemsize(like: Array) -> int:
    """The bytes of one entry of ``like``'s dtype."""
    return like.element_size() if isinstance(like, torch.Tensor) else like.dtype.itemsize


def _progress(total: int, what: str) -> tqdm:
    """A progress bar over ``total`` steps, as the passes over datasets show them: on a
    terminal after a second, on rank 0 only (``TQDM_DISABLE=1`` turns it off)."""
    here = current()
    return tqdm(total=total, desc=f"curvgap {what}", unit="chunk", leave=False, delay=1.0,
                disable=True if here is not None and here[0] != 0 else None)


def _checked_ties(ties: Any, names: list[str]) -> tuple[dict[str, str], set[str]]:
    """``ties`` (tied parameter → the parameter it is read as, ``".T"`` appended where it is
    read transposed) checked against the chain's parameter ``names``: ``(tied → source,
    the tied names read transposed)``."""
    if not isinstance(ties, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
        raise TypeError(f"ties: expected a dict of parameter names (tied → source, or "
                        f"source + '.T' read transposed), got {ties!r}")
    sources = {tied: source.removesuffix(".T") for tied, source in ties.items()}
    for tied, source in sources.items():
        if tied not in names or source not in names:
            raise ValueError(f"ties: expected names of the parts' parameters (such as "
                             f"{names[-1]!r}), got {tied!r} → {ties[tied]!r}")
        if tied == source or source in sources:
            raise ValueError(f"ties: expected {tied!r} tied to an untied parameter, got "
                             f"{source!r}")
    return sources, {tied for tied, source in ties.items() if source.endswith(".T")}


class Chain:
    """Parts applied one after another, ``Z_k = part_k(Z_{k-1}; θ_k)``, ``Z_0 = X``, each part
    a ``(prefix, config)`` of any kind whose input is the previous part's output (an
    embedding, blocks, a norm, a head), the last part's loss on the output. Parameters are named
    ``"<prefix>.<name>"`` in part order, each part's in its module's ``PARAMS`` order.
    Inputs are the ``backend``'s arrays (torch tensors, or numpy arrays), ``X`` of the first
    part's input shape, ``(B, L, d)`` or ``(B, L, p)`` for an embedding. ``loss``,
    ``gradient``, ``loss_hessian``, ``diagonal``, ``hvp`` and ``gnvp`` also take, in place of
    ``X, target``, a dataset's batches: the mean over its samples (:mod:`curvgap.data`).

    ``ties`` maps a part's parameter to another that it is (``{"blocks.1.E_rel":
    "blocks.0.E_rel"}``: one relative-bias table for every block), or, with ``".T"``, that
    it is transposed (``{"head.W_H": "embedding.W_E.T"}``: a language-model head tied to its
    token embedding, ``W_H = W_E^T``): the tied one leaves ``PARAMS``, and every derivative
    over the other sums its places (the Hessian over it is ``S^T H S`` with ``S`` stacking the
    identity and the transpositions, applied as an index map, never formed).

    ``fused=True`` (torch): every part's sweeps run through ``torch.compile(fullgraph=True)``,
    compiled on first use for each set of sizes."""

    def __init__(self, parts: list[tuple[str, Config | Program]],
                 backend: str = "torch", ties: dict[str, str] | None = None,
                 fused: bool = False) -> None:
        if not parts:
            raise ValueError("parts: expected at least one (prefix, config), got none")
        if backend not in ("torch", "numpy"):
            raise ValueError(f"backend: expected 'torch' or 'numpy', got {backend!r}")
        self.backend = backend
        self.prefixes = [prefix for prefix, _ in parts]
        # every part but the last with the linear loss: its second derivatives against the
        # cotangent from above; the last with the model's loss
        self.modules: list[ModuleType] = [
            module_for(dataclasses.replace(config, loss="linear"), backend, fused)
            for _, config in parts[:-1]] + [module_for(parts[-1][1], backend, fused)]
        self.part_params = [[name for name, _ in module.PARAMS] for module in self.modules]
        # inputs computed for each call (a program's masks and tables), passed beside the
        # parameters as "<prefix>.<name>"
        self.part_constants = [[name for name, _ in getattr(module, "CONSTANTS", ())]
                               for module in self.modules]
        empty = [prefix for prefix, names in zip(self.prefixes, self.part_params) if not names]
        if empty:
            raise ValueError(f"parts: expected parts with parameters, got none in {empty}")
        every = [_key(prefix, name) for prefix, names in zip(self.prefixes, self.part_params)
                 for name in names]
        self.ties, self.transposed = _checked_ties(ties or {}, every)
        self.PARAMS = [name for name in every if name not in self.ties]
        self.CONSTANTS = [_key(prefix, name) for prefix, names in zip(self.prefixes,
                                                                       self.part_constants)
                          for name in names]
        self.depth = len(parts)
        #: what the last :meth:`diagonal` cost (:class:`DiagonalCost`; None before one)
        self.diagonal_cost: DiagonalCost | None = None

    def parameter_shapes(self, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter in ``PARAMS`` order for the sizes ``sizes`` (``L``,
        ``d``, ``d_k``, ``d_ff``, and ``p``, ``c`` for an embedding or a head, as the parts
        need)."""
        shapes = {}
        for prefix, module in zip(self.prefixes, self.modules):
            dims = {**sizes, **getattr(module, "_CONSTANT_DIMS", {})}
            if "h" in dims and "d" in dims:
                dims["d_v"] = dims["d"] // dims["h"]
            for name, shape in module.PARAMS:
                try:
                    shapes[_key(prefix, name)] = tuple(
                        int(np.prod([dims[factor] for factor in size.split("*")]))
                        for size in shape)
                except KeyError as missing:
                    raise ValueError(f"sizes: expected the size {missing} of {prefix}.{name} "
                                     f"(shape {shape}), got {sorted(sizes)}") from None
        for tied, source in self.ties.items():
            expected = shapes[source][::-1] if tied in self.transposed else shapes[source]
            if shapes[tied] != expected:
                how = " transposed" if tied in self.transposed else ""
                raise ValueError(f"sizes: {tied} is {source}{how}, so its shape must be "
                                 f"{expected}; these sizes give {shapes[tied]}")
            del shapes[tied]
        return shapes

    def _layers(self, params: dict[str, Array]) -> list[dict[str, Array]]:
        expected = self.PARAMS + self.CONSTANTS
        missing = [name for name in expected if name not in params]
        unknown = sorted(set(params) - set(expected))
        if missing or unknown:
            raise ValueError(f"params: expected exactly the keys {expected}, got unknown "
                             f"{unknown} and missing {missing}")
        params = self._untie(params)
        return [{name: params[_key(prefix, name)] for name in [*names, *constants]}
                for prefix, names, constants in zip(self.prefixes, self.part_params,
                                                    self.part_constants)]

    def _inputs(self, layers: list[dict], X: Array) -> list[Array]:
        """``Z_0 = X, Z_1, …, Z_{N-1}``: the input of each part."""
        inputs = [X]
        for module, params in zip(self.modules[:-1], layers[:-1]):
            inputs.append(module.forward(params, inputs[-1]))
        return inputs

    def forward(self, params: dict[str, Array], X: Array) -> Array:
        """``Z_N``, the last part's output, per sample (``(B, L, d)`` for a block)."""
        layers = self._layers(params)
        return self.modules[-1].forward(layers[-1], self._inputs(layers, X)[-1])

    @over_batches()
    def loss(self, params: dict[str, Array], X: Array, target: Array) -> Array:
        """The config's loss of ``Z_N`` per sample, averaged over the batch."""
        layers = self._layers(params)
        return self.modules[-1].loss(layers[-1], self._inputs(layers, X)[-1], target)

    def _cat(self, arrays: list[Array]) -> Array:
        return torch.cat(arrays) if self.backend == "torch" else np.concatenate(arrays)

    def _cat_last(self, arrays: list[Array]) -> Array:
        return (torch.cat(arrays, dim=-1) if self.backend == "torch"
                else np.concatenate(arrays, axis=-1))

    def _zeros(self, n: int, like: Array) -> Array:
        if self.backend == "torch":
            return torch.zeros(n, n, dtype=like.dtype, device=like.device)
        return np.zeros((n, n), dtype=like.dtype)

    def _saved(self, layers: list[dict], X: Array, start: int = 0) -> list:
        """Each part's saved call (:func:`forward_saved` of its module) from part ``start``
        up (``None`` below it), ``X`` the input of part 0; the input of each part is its
        saved ``X``."""
        saved: list = [None] * self.depth
        Z = X
        for k in range(self.depth):
            if k < start:
                Z = self.modules[k].forward(layers[k], Z)
            else:
                Z, saved[k] = self.modules[k].forward_saved(layers[k], Z)
        return saved

    def _part_out(self, k: int, out: dict[str, Array] | None) -> dict[str, Array] | None:
        """The arrays of ``out`` (name of ``PARAMS`` → array) that part ``k``'s results go
        into, by the part's own names (None: none)."""
        if not out:
            return None
        keys = {name: _key(self.prefixes[k], name) for name in self.part_params[k]}
        return {name: out[key] for name, key in keys.items() if key in out} or None

    def _backward(self, layers: list[dict], X: Array, target: Array,
                  out: dict[str, Array] | None = None) -> tuple[list, list]:
        """One forward pass and one adjoint sweep: per part its input ``Z_{k-1}``, and
        ``(gradients, g)``: its parameters' gradients (a dict of arrays averaged over the
        batch; those named in ``out`` written there) and the cotangent ``∂ℓ_b/∂Z_{k-1}`` of
        its input per sample (shaped as the input), the first part's being the gradient in
        ``X``."""
        saved = self._saved(layers, X)
        inputs = [part["_like"] for part in saved]
        gradients, cotangents, cotangent = [None] * self.depth, [None] * self.depth, target
        for k in range(self.depth - 1, -1, -1):
            gradients[k], cotangent = self.modules[k].vjp_saved(saved[k], cotangent,
                                                                out=self._part_out(k, out))
            cotangents[k], saved[k] = cotangent, None  # its forward values are freed
        return inputs, gradients, cotangents

    def _cotangents(self, layers: list[dict], X: Array, target: Array) -> tuple[list, list]:
        """Every part's input, and per part ``k < N-1`` the cotangent ``∂ℓ_b/∂Z`` of its output
        per sample (shaped as that output, the next part's input); ``None`` for the top part,
        whose loss is the model's own."""
        inputs, _, cotangents = self._backward(layers, X, target)
        return inputs, [*cotangents[1:], None]

    def _finished(self, value: Array, like: Array, quantity: str) -> Array:
        """``value`` in the dtype of ``like``; FloatingPointError where it is not finite
        (every input was checked finite: the arithmetic overflowed)."""
        finite = (bool(torch.isfinite(value).all()) if self.backend == "torch"
                  else bool(np.isfinite(value).all()))
        if not finite:
            raise overflowed(quantity, value.dtype)
        return self._cast(value, like)

    def _wide(self, a: Any) -> Any:
        """``a`` in the dtype it is computed in: float16 and bfloat16 arrays in float32, so
        that every part computes in it (anything else as it is)."""
        if self.backend == "torch":
            narrow = isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16)
            return a.float() if narrow else a
        return a.astype(np.float32) if getattr(a, "dtype", None) == np.float16 else a

    def _widened(self, params: dict[str, Array], X: Array, *others: Array) -> tuple:
        """``params``, ``X`` and ``others`` in the dtype they are computed in
        (:meth:`_wide`): ``(params, X, others)``."""
        return ({k: self._wide(a) for k, a in params.items()}, self._wide(X),
                tuple(self._wide(o) for o in others))

    def gradient_pieces(self, params: dict[str, Array], X: Array, target: Array,
                        out: dict[str, Array] | None = None) -> tuple[dict[str, Array], Array]:
        """One forward pass and one adjoint sweep through every part: each parameter's
        gradient (name of ``PARAMS`` → array of the parameter's size; ``reshape(-1)`` is its
        ``vec_r``), and per sample the gradient of each sample's own loss in its input, shaped
        as ``X`` — in the dtype they are computed in (float16 and bfloat16 in float32), not
        yet checked for overflow (:meth:`gradient` assembles and checks them). ``out`` (name
        of ``PARAMS`` → a contiguous array of its size, in X's dtype): those gradients are
        written there, by the matrix products that make them where they can (no second
        array, no copy), and returned as views of it; ignored for float16 and bfloat16."""
        out = self._computed_out(out, X)
        params, X, (target,) = self._widened(params, X, target)
        _, gradients, cotangents = self._backward(self._layers(params), X, target, out)
        return (self._folded({_key(prefix, name): value
                              for prefix, part in zip(self.prefixes, gradients)
                              for name, value in part.items()}, out), cotangents[0])

    def _computed_out(self, out: dict[str, Array] | None, X: Array) -> dict[str, Array] | None:
        """``out`` where results are computed in X's dtype (None where X is widened)."""
        if out and self._wide(X) is X:
            unknown = sorted(set(out) - set(self.PARAMS))
            if unknown:
                raise ValueError(f"out: expected arrays for names of PARAMS, got {unknown}")
            return out
        return None

    def _flat_out(self, params: dict[str, Array], names: list[str], like: Array
                  ) -> tuple[Array, dict[str, Array]]:
        """An empty flat array for the results over ``names`` (in order, in the dtype ``like``
        is computed in), and name → its slice for each."""
        self._layers(params)  # a worded error for missing or unknown keys
        like = self._wide(like)
        sizes = [int(np.prod(params[name].shape)) for name in names]
        flat = (torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
                if self.backend == "torch" else np.empty(sum(sizes), dtype=like.dtype))
        offsets = np.cumsum([0, *sizes])
        return flat, {name: flat[offsets[i]:offsets[i + 1]] for i, name in enumerate(names)}

    @over_batches()
    def gradient(self, params: dict[str, Array], X: Array, target: Array,
                 wrt: str | None = None) -> Array:
        """The loss's gradient over every parameter in ``PARAMS`` order, ``(n,)``; with
        ``wrt="X"``, per sample the gradient of each sample's own loss in its input,
        ``(B, n_X)``. One forward pass and one adjoint sweep through every part."""
        if wrt not in (None, "X"):
            raise ValueError(f"wrt: expected None (every parameter) or 'X', got {wrt!r}")
        single = len(X.shape) == len(self.modules[0].INPUT_SHAPE)
        flat, out = (None, None) if wrt == "X" else self._flat_out(params, self.PARAMS, X)
        pieces, in_X = self.gradient_pieces(params, X[None] if single else X,
                                            target[None] if single else target, out)
        if wrt == "X":
            value = in_X.reshape(in_X.shape[0], -1)
            return self._finished(value[0] if single else value, X, "the gradient in X")
        for name in self.PARAMS:
            written(out[name], pieces[name])
        return self._finished(flat, X, "the gradient")

    def _chosen(self, wrt: str | list[str] | None, tied: bool = True) -> list[list[str]]:
        """Per part, the names of its parameters in ``wrt`` (default: all), in its order,
        with (``tied``) the other places a tie reads them."""
        names = self.PARAMS if wrt is None else [wrt] if isinstance(wrt, str) else list(wrt)
        unknown = [n for n in names if n not in self.PARAMS]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(f"wrt: expected distinct names of PARAMS (such as "
                             f"{self.PARAMS[0]!r}), got {names}")
        if tied:
            names = [*names, *(t for t, source in self.ties.items() if source in names)]
        return [[n for n in part if _key(prefix, n) in names]
                for prefix, part in zip(self.prefixes, self.part_params)]

    # -- ties: a parameter read again (or transposed) in another place -----------------------
    def _as_tied(self, tied: str, value: Array) -> Array:
        """``value``, of the shape of ``tied``'s source, as ``tied`` reads it (a view)."""
        return value.T if tied in self.transposed else value

    def _untie(self, params: dict[str, Array]) -> dict[str, Array]:
        """``params`` with each tied parameter as it reads its source."""
        if not self.ties:
            return params
        return {**params, **{tied: self._as_tied(tied, params[source])
                             for tied, source in self.ties.items()}}

    def _folded(self, pieces: dict[str, Array], out: dict[str, Array] | None = None
                ) -> dict[str, Array]:
        """Per-parameter results (name → array shaped as the parameter) with each tied
        parameter's added, in its source's layout, to its source's (in place where the
        source's result was written into its array of ``out``)."""
        for tied, source in self.ties.items():
            if tied in pieces:
                value = self._as_tied(tied, pieces.pop(tied))
                if out and source in out:
                    pieces[source] += value
                else:
                    pieces[source] = pieces[source] + value
        return pieces

    def _tie_index(self, params: dict[str, Array], chosen: list[list[str]]
                   ) -> tuple[np.ndarray, int] | None:
        """For the entries of ``chosen`` (per part, as the Hessian's rows are laid out),
        ``(position of each in the result over PARAMS, the result's size)``, a tied entry at
        its source's; None when no tie is chosen."""
        names = [_key(prefix, n) for prefix, part in zip(self.prefixes, chosen) for n in part]
        if not any(n in self.ties for n in names):
            return None
        starts, offset = {}, 0
        for name in names:
            if name not in self.ties:
                starts[name], offset = offset, offset + int(np.prod(params[name].shape))
        index = []
        for name in names:
            if name in self.ties:  # a transposed tie's entry (i, j) is its source's (j, i)
                source = params[self.ties[name]]
                index.append(starts[self.ties[name]] + self._as_tied(
                    name, np.arange(int(np.prod(source.shape))).reshape(source.shape)
                ).reshape(-1))
            else:
                index.append(starts[name] + np.arange(int(np.prod(params[name].shape))))
        return np.concatenate(index), offset

    def _fold_axes(self, value: Array, tie: tuple | None, axes: tuple[int, ...]) -> Array:
        """``value`` with its ``axes`` (laid out over the chosen entries, ties included)
        summed into the entries of ``PARAMS`` by the index map ``tie``."""
        if tie is None:
            return value
        index, n = tie
        for axis in axes:
            shape = list(value.shape)
            shape[axis] = n
            if self.backend == "torch":
                value = value.new_zeros(shape).index_add_(
                    axis, torch.as_tensor(index, device=value.device), value)
            else:
                out = np.zeros(shape, dtype=value.dtype)
                np.add.at(out, (slice(None),) * (axis % value.ndim) + (index,), value)
                value = out
        return value

    def _refuse_ties(self, chosen: list[list[str]], what: str) -> None:
        tied = [self.ties[_key(prefix, n)] for prefix, part in zip(self.prefixes, chosen)
                for n in part if _key(prefix, n) in self.ties]
        if tied:
            raise NotImplementedError(
                f"{what}: {tied[0]} is tied (read in several places); its {what} needs the "
                f"blocks between those places: use loss_hessian(wrt={tied[0]!r}), or leave it "
                f"out of wrt")

    def part_slices(self, params: dict[str, Array], wrt: str | list[str] | None = None
                    ) -> dict[str, slice]:
        """Where each part's block of rows lies in ``loss_hessian`` (and ``gradient``, ``hvp``)
        over ``wrt``: part prefix → slice (the parts with no parameter in ``wrt`` left out)."""
        slices, offset = {}, 0
        for prefix, names in zip(self.prefixes, self._chosen(wrt, tied=False)):
            size = sum(int(np.prod(params[_key(prefix, n)].shape)) for n in names)
            if size:
                slices[prefix] = slice(offset, offset + size)
            offset += size
        return slices

    @over_batches()
    def loss_hessian(self, params: dict[str, Array], X: Array, target: Array,
                     wrt: str | list[str] | None = None, part: str = "full") -> Array:
        """The loss Hessian over ``wrt`` (names of ``PARAMS``; default: all), ``(n, n)``
        with its blocks in ``PARAMS`` order (arranged by part: :meth:`part_slices`),
        cross-part blocks included; with ``wrt="X"``, per sample the Hessian of each
        sample's own loss in its input, ``(B, n_X, n_X)``. ``part`` is ``"full"``,
        ``"gauss_newton"`` (``J^T ∂²ℓ/∂Z_N² J`` with ``J`` the whole model's Jacobian: only
        the top part's own Gauss–Newton term, carried down; the inner parts' linear losses
        have none) or ``"functional"`` (the rest). Only the parts from the lowest one in
        ``wrt`` up are visited."""
        if part == "functional":
            return (self.loss_hessian(params, X, target, wrt)
                    - self.loss_hessian(params, X, target, wrt, "gauss_newton"))
        if isinstance(wrt, str) and wrt == "X":
            return self._backpropagate(params, X, target, [[]] * self.depth, part, True)[1]
        chosen = self._chosen(wrt)
        return self._fold_axes(self._backpropagate(params, X, target, chosen, part, False)[0],
                               self._tie_index(params, chosen), (0, 1))

    def loss_hessian_mixed(self, params: dict[str, Array], X: Array, target: Array,
                           wrt: str | list[str] | None = None, part: str = "full") -> Array:
        """Per sample, the block of each sample's own loss Hessian between its input and the
        parameters ``wrt`` (default: all of ``PARAMS``), ``(B, n_X, n)``; ``part`` as for
        :meth:`loss_hessian`."""
        if part == "functional":
            return (self.loss_hessian_mixed(params, X, target, wrt)
                    - self.loss_hessian_mixed(params, X, target, wrt, "gauss_newton"))
        chosen = self._chosen(wrt)
        return self._fold_axes(self._backpropagate(params, X, target, chosen, part, True)[2],
                               self._tie_index(params, chosen), (-1,))

    def _backpropagate(self, params: dict[str, Array], X: Array, target: Array,
                       chosen: list[list[str]], part: str, to_input: bool) -> tuple:
        """Hessian backpropagation over the parameters ``chosen`` (per part), from the top
        part down to the lowest part with one of them (``to_input``: down to the input):
        ``(H (n, n), ∂²ℓ_b/∂X² (B, n_X, n_X) or None, ∂²ℓ_b/∂X∂θ (B, n_X, n) or None)``."""
        if part not in ("full", "gauss_newton"):
            raise ValueError(f"part: expected 'full', 'gauss_newton' or 'functional', got "
                             f"{part!r}")
        like = X
        params, X, (target,) = self._widened(params, X, target)
        layers = self._layers(params)
        inputs, g = self._cotangents(layers, X, target)
        lowest = 0 if to_input else min(k for k, names in enumerate(chosen) if names)
        J_X = {k: self.modules[k].jacobian(layers[k], inputs[k], "X")
               for k in range(lowest, self.depth - 1)}
        J_t = {k: self._cat_last([self.modules[k].jacobian(layers[k], inputs[k], name)
                                  for name in names])
               for k, names in enumerate(chosen) if names}
        sizes = [J_t[k].shape[-1] if k in J_t else 0 for k in range(self.depth)]
        offsets = [sum(sizes[:k]) for k in range(self.depth + 1)]
        H = self._zeros(offsets[-1], X)
        mixed = [] if to_input else None  # the (X, θ_k) blocks, part by part
        batch, M = X.shape[0], None  # M: ∂²ℓ_b/∂Z², per sample, at the output of part k
        for k in range(self.depth - 1, lowest - 1, -1):
            module, names = self.modules[k], chosen[k]
            args = (layers[k], inputs[k], target if k == self.depth - 1 else g[k])
            H_XX = None
            # M = U diag(λ) U^T per sample, when it has low rank (behind a cross-entropy
            # head, rank ≤ classes - 1): the products with M then go through U^T J
            factor = None if M is None else self._low_rank(M)
            if factor is not None:
                U, scale = factor
                G_X = U.swapaxes(1, 2) @ J_X[k] if k in J_X else None
            if k > lowest or to_input:
                H_XX = module.loss_hessian(*args, wrt="X", part=part)
                if factor is not None:  # the curvature from above, carried
                    H_XX = H_XX + G_X.swapaxes(1, 2) @ (scale[..., None] * G_X)
                elif M is not None:
                    H_XX = H_XX + J_X[k].swapaxes(1, 2) @ (M @ J_X[k])
            if names:
                H_Xt = module.loss_hessian_mixed(*args, wrt=names, part=part)
                H_tt = module.loss_hessian(*args, wrt=names, part=part)
                if factor is not None:
                    G_t = U.swapaxes(1, 2) @ J_t[k]
                    scaled = scale[..., None] * G_t
                    H_Xt = H_Xt + G_X.swapaxes(1, 2) @ scaled
                    H_tt = H_tt + (G_t.reshape(-1, sizes[k]).T  # mean over samples
                                   @ scaled.reshape(-1, sizes[k])) / batch
                elif M is not None:
                    MJ_t = M @ J_t[k]
                    H_Xt = H_Xt + J_X[k].swapaxes(1, 2) @ MJ_t
                    H_tt = H_tt + (J_t[k].reshape(-1, sizes[k]).T  # mean over samples
                                   @ MJ_t.reshape(-1, sizes[k])) / batch
                rows = slice(offsets[k], offsets[k + 1])
                H[rows, rows] = H_tt
                carried = H_Xt  # ∂²ℓ_b/∂Z_a∂θ_k for the output Z_a of each part a below
                for a in range(k - 1, lowest - 1, -1):
                    if a in J_t:  # mean over samples (and a sum over the output's entries)
                        block = (J_t[a].reshape(-1, sizes[a]).T
                                 @ carried.reshape(-1, sizes[k])) / batch
                        H[offsets[a]:offsets[a + 1], rows] = block
                        H[rows, offsets[a]:offsets[a + 1]] = block.T
                    if a > lowest or to_input:
                        carried = J_X[a].swapaxes(1, 2) @ carried
                if to_input:
                    mixed.insert(0, carried)
            M = H_XX
        if not to_input:
            return self._cast(H, like), None, None
        return (self._cast(H, like), self._cast(M, like),
                self._cast(self._cat_last(mixed), like) if mixed else None)

    def _cast(self, value: Array, like: Array) -> Array:
        """``value`` in the dtype of ``like``."""
        return value.to(like.dtype) if self.backend == "torch" else value.astype(like.dtype)

    def _low_rank(self, M: Array) -> tuple[Array, Array] | None:
        """``(U, λ)`` with ``M_b = U_b diag(λ_b) U_b^T`` for every sample ``b`` (``U`` of
        shape ``(B, n, r)``), when every ``M_b`` has rank ``r ≤ n/4``: eigenvalues within
        ``n·eps·max|λ_b|`` of zero, the rounding of an exact zero, are dropped. Else None."""
        n = M.shape[-1]
        if self.backend == "torch":
            values, vectors = torch.linalg.eigh(M)
            eps, magnitude = torch.finfo(M.dtype).eps, values.abs()
            order = torch.argsort(magnitude, dim=-1, descending=True)
        else:
            values, vectors = np.linalg.eigh(M)
            eps, magnitude = np.finfo(M.dtype).eps, np.abs(values)
            order = np.argsort(-magnitude, axis=-1)
        largest = magnitude.max(-1, keepdims=True)
        if self.backend == "torch":
            largest = largest.values
        rank = int((magnitude > n * eps * largest).sum(-1).max())
        if rank > n // 4:
            return None
        kept = order[..., :rank]
        if self.backend == "torch":
            return (torch.take_along_dim(vectors, kept[:, None, :], dim=-1),
                    torch.take_along_dim(values, kept, dim=-1))
        return (np.take_along_axis(vectors, kept[:, None, :], axis=-1),
                np.take_along_axis(values, kept, axis=-1))

    @over_batches()
    def diagonal(self, params: dict[str, Array], X: Array, target: Array,
                 wrt: str | list[str] | None = None, part: str = "full",
                 max_memory: int | None = None, chunk: int | None = None) -> Array:
        """The diagonal of :meth:`loss_hessian` over ``wrt`` (default: all of ``PARAMS``),
        ``(n,)`` in ``PARAMS`` order, or with ``wrt="X"`` per sample ``(B, n_X)``, without
        forming a Hessian block over parameters: per part ``k``, the module's own diagonal
        against its cotangent plus ``mean_b diag(J_θ^T M_k J_θ)``, ``M_k`` the curvature at
        its output.

        ``max_memory`` (bytes, default :data:`DIAGONAL_MEMORY`, 2 GiB) bounds the work held at
        once beyond the inputs and the result. Where the dense route fits it (per sample
        ``M_k``, ``n_Z × n_Z``, and each part's Jacobian ``J_θ``, ``n_Z × n_θ``) it is taken;
        else ``M_k`` is never formed: per sample, columns ``e_c`` of the identity at each
        part's input go in chunks through that part's second derivative (``S e_c``, the
        part's input Hessian against its cotangent, the top part's against the loss), and the
        pair ``(S e_c, e_c)`` down the parts below it by per-sample transposed Jacobians, whose
        parameter products ``Σ_c (J^T S e_c) ∘ (J^T e_c)`` sum to ``diag(J^T M J)``; each
        part's own diagonal is taken a few rows of each parameter at a time. ``chunk`` fixes
        the columns that go down together (each as a pair, so batches of ``2·chunk``; the
        route is then the chunked one); by default the most that ``max_memory`` holds. What it
        cost is kept in :attr:`diagonal_cost` (:class:`DiagonalCost`); a long run shows a
        progress bar over samples and chunks."""
        if part == "functional":
            return (self.diagonal(params, X, target, wrt, max_memory=max_memory, chunk=chunk)
                    - self.diagonal(params, X, target, wrt, "gauss_newton", max_memory, chunk))
        if part not in ("full", "gauss_newton"):
            raise ValueError(f"part: expected 'full', 'gauss_newton' or 'functional', got "
                             f"{part!r}")
        budget = _budget(max_memory)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ValueError(f"chunk: expected a positive int (columns per chunk) or None "
                             f"(as many as max_memory holds), got {chunk!r}")
        to_input = isinstance(wrt, str) and wrt == "X"
        chosen = [[]] * self.depth if to_input else self._chosen(wrt)
        self._refuse_ties(chosen, "diagonal")
        like = X
        params, X, (target,) = self._widened(params, X, target)
        layers = self._layers(params)
        inputs, g = self._cotangents(layers, X, target)
        lowest = 0 if to_input else min(k for k, names in enumerate(chosen) if names)
        dense = self._dense_bytes(layers, inputs, chosen, lowest)
        if chunk is None and dense <= budget:
            check_room(dense, X.device if isinstance(X, torch.Tensor) else "cpu",
                       f"diagonal: the dense route that max_memory ({budget} bytes) allows",
                       "a max_memory below the memory at hand (default 2 GiB: the columns "
                       "go through the model in chunks)")
            self.diagonal_cost = DiagonalCost("dense", X.shape[0], self.depth)
            pieces, diag_X = self._diagonal_dense(layers, inputs, g, target, chosen, lowest,
                                                  to_input, part)
        else:
            pieces, diag_X = self._diagonal_chunked(layers, inputs, g, target, chosen,
                                                    lowest, to_input, part, budget, chunk)
        self.diagonal_cost.dense_bytes = dense
        if to_input:
            return self._cast(diag_X, like)
        return self._cast(self._cat([pieces[k] for k in range(lowest, self.depth)
                                     if chosen[k]]), like)

    def _dense_bytes(self, layers: list[dict], inputs: list[Array],
                     chosen: list[list[str]], lowest: int) -> int:
        """What the dense route holds at its largest, in bytes: per part the curvature ``M``,
        its input Jacobian and the next ``M`` (``3 B n_Z²``) and the parameter Jacobian with
        its product (``2 B n_Z n_θ``), or the tangents of the part's own diagonal of a
        parameter whole (all its rows at once), if more."""
        batch, largest, own = inputs[0].shape[0], 0, 0
        for k in range(lowest, self.depth):
            outputs = (int(np.prod(inputs[k + 1].shape[1:])) if k + 1 < self.depth else
                       int(np.prod(self.modules[k].forward(
                           self._sample(k, layers[k], 0, 1),
                           inputs[k][:1]).shape[1:])))
            n_in = int(np.prod(inputs[k].shape[1:]))
            n_theta = sum(int(np.prod(layers[k][name].shape)) for name in chosen[k])
            largest = max(largest, 2 * outputs ** 2 + n_in ** 2 + 2 * outputs * n_theta)
            for name in chosen[k]:
                rows, _, held = self.modules[k].diagonal_row_layout(layers[k], inputs[k], name)
                own = max(own, rows * held)
        return max(batch * largest, own) * _itemsize(inputs[0])

    def _diagonal_dense(self, layers: list[dict], inputs: list[Array], g: list,
                        target: Array, chosen: list[list[str]], lowest: int, to_input: bool,
                        part: str) -> tuple[list, Array | None]:
        """The dense route: ``M_k`` per sample carried down as in :meth:`loss_hessian`.
        Per part its diagonal (or None), and per sample the input's diagonal (or None)."""
        pieces, M = [None] * self.depth, None
        batch = inputs[0].shape[0]
        for k in range(self.depth - 1, lowest - 1, -1):
            module, names = self.modules[k], chosen[k]
            args = (layers[k], inputs[k], target if k == self.depth - 1 else g[k])
            if names:
                pieces[k] = module.diagonal(*args, wrt=names, part=part)
                if M is not None:
                    J_t = self._cat_last([module.jacobian(layers[k], inputs[k], name)
                                          for name in names])
                    pieces[k] = pieces[k] + ((M @ J_t) * J_t).sum(axis=(0, 1)) / batch
            if k > lowest or to_input:
                J_X = module.jacobian(layers[k], inputs[k], "X")
                H_XX = module.loss_hessian(*args, wrt="X", part=part)
                M = H_XX if M is None else H_XX + J_X.swapaxes(1, 2) @ (M @ J_X)
        return pieces, (M * self._eye(M)).sum(-1) if to_input else None

    def _sample(self, k: int, layer: dict[str, Array], b: int, copies: int) -> dict:
        """Part ``k``'s parameters and constants for ``copies`` copies of sample ``b`` (the
        constants with a batch axis, ``_BATCHED``, taken at ``b`` and repeated)."""
        batched = getattr(self.modules[k], "_BATCHED", ())
        return {name: self._tile(value[b:b + 1], copies) if name in batched else value
                for name, value in layer.items()}

    def _tile(self, a: Array, copies: int) -> Array:
        """``a`` (a batch of one) repeated ``copies`` times along its first axis."""
        if self.backend == "torch":
            return a.repeat(copies, *([1] * (a.ndim - 1)))
        return np.repeat(a, copies, axis=0)

    def _unit(self, n: int, start: int, count: int, like: Array) -> Array:
        """Columns ``start … start + count − 1`` of the ``n × n`` identity as rows,
        ``(count, n)``; rows past ``n`` are zero."""
        if self.backend == "torch":
            E = torch.zeros(count, n, dtype=like.dtype, device=like.device)
            rows = torch.arange(min(count, n - start), device=like.device)
        else:
            E = np.zeros((count, n), dtype=like.dtype)
            rows = np.arange(min(count, n - start))
        E[rows, rows + start] = 1
        return E

    def _diagonal_chunked(self, layers: list[dict], inputs: list[Array], g: list,
                          target: Array, chosen: list[list[str]], lowest: int,
                          to_input: bool, part: str, budget: int, chunk: int | None
                          ) -> tuple[list, Array | None]:
        """The chunked route (see :meth:`diagonal`): per part its diagonal (or None), and per
        sample the input's diagonal (or None); :attr:`diagonal_cost` records its sweeps."""
        top, batch = self.depth - 1, inputs[0].shape[0]
        bottom = 0 if to_input else lowest
        # the parts whose input Hessian is a source: every part above the lowest one asked
        # for (and the lowest too for the input); the Gauss–Newton part has only the top's
        sources = [j for j in range(top, bottom - 1, -1) if j > lowest or to_input]
        if part == "gauss_newton":
            sources = sources[:1] if sources and sources[0] == top else []
        sizes = [int(np.prod(inputs[j].shape[1:])) for j in range(self.depth)]
        if chunk is None:
            chunk = self._chunk_width(layers, inputs, g, target, sources, bottom, chosen,
                                      to_input, part, budget) if sources else 1
        cost = DiagonalCost("chunked", batch, self.depth, chunk)
        self.diagonal_cost = cost
        totals = [[None] * len(names) for names in chosen]  # Σ over samples, by name
        diag_X = []
        steps = batch * sum(-(-sizes[j] // (2 * chunk)) for j in sources)
        with _progress(steps, "diagonal") as bar:
            for b in range(batch if sources else 0):
                saved = self._tiled_saved(layers, inputs, b, 2 * chunk, bottom)
                tiled = self._tiled_targets(g, target, b, 2 * chunk, sources)
                value_X = None
                for j in sources:
                    for start in range(0, sizes[j], 2 * chunk):
                        value_X = self._source_chunk(saved, tiled, j, start, 2 * chunk, sizes,
                                                     inputs[j], chosen, bottom, to_input, part,
                                                     totals, value_X, cost)
                        bar.update(1)
                if to_input:
                    diag_X.append(value_X)
                saved = tiled = None  # freed before the next sample's copies are made
        pieces: list = [None] * self.depth
        for k in range(lowest, self.depth):
            if chosen[k]:
                own = self._own_diagonal(layers, inputs, g, target, k, chosen[k], part,
                                         budget, cost)
                pieces[k] = self._cat([
                    value if totals[k][i] is None else value + totals[k][i].reshape(-1) / batch
                    for i, value in enumerate(own)])
        stacked = (torch.stack(diag_X) if self.backend == "torch" else np.stack(diag_X)
                   ) if to_input else None
        return pieces, stacked

    def _tiled_saved(self, layers: list[dict], inputs: list[Array], b: int, copies: int,
                     bottom: int) -> list:
        """Each part's saved forward call from ``bottom`` up, on ``copies`` copies of sample
        ``b`` (``None`` below ``bottom``)."""
        saved: list = [None] * self.depth
        for k in range(bottom, self.depth):
            saved[k] = self.modules[k].forward_saved(
                self._sample(k, layers[k], b, copies), self._tile(inputs[k][b:b + 1],
                                                                  copies))[1]
        return saved

    def _tiled_targets(self, g: list, target: Array, b: int, copies: int,
                       sources: list[int]) -> dict[int, Array]:
        """The target each source part's second derivative is taken against, ``copies``
        copies of sample ``b``'s: the loss's target for the top part, the cotangent of its
        output for the others."""
        top = self.depth - 1
        return {j: self._tile((target if j == top else g[j])[b:b + 1], copies)
                for j in sources}

    def _source_chunk(self, saved: list, tiled: dict[int, Array], j: int, start: int,
                      width: int, sizes: list[int], like: Array, chosen: list[list[str]],
                      bottom: int, to_input: bool, part: str, totals: list[list],
                      value_X: Array | None, cost: DiagonalCost) -> Array | None:
        """One chunk of ``width`` columns of the identity at the input of source part ``j``
        (from column ``start``): ``S E`` by part ``j``'s per-sample input products, then the
        pairs ``(S e_c, e_c)``, half the chunk at a time, down to part ``bottom``, adding
        ``Σ_c (J^T S e_c) ∘ (J^T e_c)`` into ``totals`` (per part and parameter) and into
        the input's diagonal, which is returned (None while nothing has reached it)."""
        module = self.modules[j]
        shape = tuple(like.shape[1:])
        E = self._unit(sizes[j], start, width, like)
        module.jvp_saved(saved[j], None, E.reshape(width, *shape))
        if part == "gauss_newton":
            SE = module.gnvp_saved(saved[j], tiled[j])[1]
            cost.add("gnvp", j, width)
        else:
            SE = module.hvp_saved(saved[j], tiled[j], None)[1]
            cost.add("hvp", j, width)
        cost.add("jvp", j, width)
        cost.columns += min(width, sizes[j] - start)
        cost.chunks += 1
        half = width // 2
        for h in range(2):
            # the pairs (S e_c, e_c) of this half as one batch: S e_c first, e_c after
            down = self._cat([SE[h * half:(h + 1) * half],
                              E[h * half:(h + 1) * half].reshape(half, *shape)])
            for k in range(j - 1, bottom - 1, -1):
                if chosen[k]:
                    grads, down = self.modules[k].vjp_per_sample_saved(saved[k], down)
                    for i, name in enumerate(chosen[k]):
                        term = (grads[name][:half] * grads[name][half:]).sum(0)
                        totals[k][i] = term if totals[k][i] is None else totals[k][i] + term
                else:
                    down = self.modules[k].vjp_saved(saved[k], down)[1]
                cost.add("vjp", k, 2 * half)
            if to_input:  # the pairs have reached X
                flat = down.reshape(2 * half, -1)
                term = (flat[:half] * flat[half:]).sum(0)
                value_X = term if value_X is None else value_X + term
        return value_X

    def _chunk_width(self, layers: list[dict], inputs: list[Array], g: list, target: Array,
                     sources: list[int], bottom: int, chosen: list[list[str]], to_input: bool,
                     part: str, budget: int) -> int:
        """The most columns per chunk whose work fits ``budget`` bytes: the most bytes held at
        once (:func:`~curvgap.models.memory.peak_bytes`) by one sample's copies and one chunk
        of each source, measured on the first sample (:func:`_most_that_fit`)."""
        sizes = [int(np.prod(inputs[j].shape[1:])) for j in range(self.depth)]

        def one_sample(width: int) -> None:
            saved = self._tiled_saved(layers, inputs, 0, 2 * width, bottom)
            tiled = self._tiled_targets(g, target, 0, 2 * width, sources)
            scratch = [[None] * len(names) for names in chosen]
            for j in sources:
                self._source_chunk(saved, tiled, j, 0, 2 * width, sizes, inputs[j], chosen,
                                   bottom, to_input, part, scratch, None,
                                   DiagonalCost("chunked", 1, self.depth))

        def held(width: int) -> int:
            return peak_bytes(partial(one_sample, width), self.backend)

        one = held(1)
        if one > budget:
            raise ValueError(f"max_memory: expected at least {one} bytes (one column's work "
                             f"in the chunked diagonal at these sizes), got {budget}")
        return _most_that_fit(held, one, -(-max(sizes[j] for j in sources) // 2), budget)

    def _own_diagonal(self, layers: list[dict], inputs: list[Array], g: list, target: Array,
                      k: int, names: list[str], part: str, budget: int,
                      cost: DiagonalCost) -> list[Array]:
        """Part ``k``'s own diagonal over ``names`` against its target (the loss's for the top
        part, else the cotangent of its output), averaged over the batch: per name the
        ``vec_r`` of its entries, one sample and as many rows of its first axis at a time as
        fit in ``budget`` bytes (their work measured on the first sample,
        :func:`_most_that_fit`)."""
        module, batch = self.modules[k], inputs[k].shape[0]
        against = target if k == self.depth - 1 else g[k]
        first = self._sample(k, layers[k], 0, 1)
        values = []
        for name in names:
            rows = module.diagonal_row_layout(first, inputs[k][:1], name)[0]

            def held(stop: int, name: str = name) -> int:
                return peak_bytes(partial(module.diagonal_rows, first, inputs[k][:1],
                                          against[:1], name, 0, stop, part), self.backend)

            one = held(1)
            if one > budget:
                raise ValueError(f"max_memory: expected at least {one} bytes (the work of one "
                                 f"row of {self.prefixes[k]}.{name} for its own diagonal), "
                                 f"got {budget}")
            step = _most_that_fit(held, one, rows, budget)
            slices = []
            for start in range(0, rows, step):
                total = None
                for b in range(batch):
                    value = module.diagonal_rows(self._sample(k, layers[k], b, 1),
                                                 inputs[k][b:b + 1], against[b:b + 1], name,
                                                 start, min(rows, start + step), part)
                    total = value if total is None else total + value
                    cost.slices += 1
                slices.append(total / batch)
            values.append(self._cat(slices))
        return values

    def _eye(self, M: Array) -> Array:
        n = M.shape[-1]
        if self.backend == "torch":
            return torch.eye(n, dtype=M.dtype, device=M.device)
        return np.eye(n, dtype=M.dtype)

    def jacobian(self, params: dict[str, Array], X: Array, wrt: str) -> Array:
        """``∂vec_r(Z_N)/∂vec_r(wrt)^T`` per sample, ``(B, n_Z, n_wrt)``, ``wrt`` a name of
        ``PARAMS`` or ``"X"``: the part's own Jacobian times the input Jacobians of the
        parts above it."""
        layers = self._layers(params)
        inputs = self._inputs(layers, X)
        places = [(0, "X")] if wrt == "X" else [
            (k, names[0]) for k, names in enumerate(self._chosen(wrt)) if names]
        total = None
        for lowest, name in places:  # one per place that reads wrt (ties)
            J = self.modules[lowest].jacobian(layers[lowest], inputs[lowest], name)
            for k in range(lowest + 1, self.depth):
                J = self.modules[k].jacobian(layers[k], inputs[k], "X") @ J
            if _key(self.prefixes[lowest], name) in self.transposed:  # in wrt's layout
                rows, cols = params[wrt].shape
                J = J[..., np.arange(rows * cols).reshape(cols, rows).T.reshape(-1)]
            total = J if total is None else total + J
        return total

    def product_pieces(self, kind: str, params: dict[str, Array], X: Array, target: Array,
                       directions: list[dict[str, Array]] | Array,
                       keep: dict | None = None, out: list[dict] | None = None) -> list:
        """``kind`` (``"hvp"`` or ``"gnvp"``) along each direction of ``directions``: a list of
        dicts (name of ``PARAMS`` → direction shaped as the parameter; those left out are
        zero), each giving a dict of the products over the parameters it names; or a per-sample
        direction in the input, shaped as ``X``, giving per sample the product in the input.
        One forward pass is kept for all directions (from the lowest part a direction moves),
        then per direction one tangent sweep up (each part's ``jvp_saved``) and one sweep down
        (``hvp_saved``: the adjoints, shared by the directions, and their tangents; ``gnvp``:
        the top part's ``gnvp_saved``, then each part's transposed Jacobians by
        ``vjp_saved``, no second derivative, so that the parts below the top drop their
        inner tangents on the way up). ``keep``, a dict its caller holds between calls
        at one point (the same ``params``, ``X`` and ``target``, as an operator does), keeps
        that forward pass and the adjoints the sweeps compute, so later calls run only the
        tangent and second-order sweeps. Results are in the dtype they are computed in, not
        yet checked for overflow; ``out`` (per direction, as for :meth:`gradient_pieces`)
        holds the arrays they are written into."""
        if kind not in ("hvp", "gnvp"):
            raise ValueError(f"kind: expected 'hvp' or 'gnvp', got {kind!r}")
        per_sample = not isinstance(directions, list)
        outs = ([None] * len(directions) if per_sample or out is None
                else [self._computed_out(o, X) for o in out])
        params, X, (target,) = self._widened(params, X, target)
        directions = (self._wide(directions) if per_sample else  # computed in X's dtype too
                      [{k: self._wide(a) for k, a in d.items()} for d in directions])
        if per_sample:
            columns, lowest = [directions], 0
        else:  # a tied parameter moves along its source's direction, as it reads it
            directions = [{**d, **{tied: self._as_tied(tied, d[source])
                                   for tied, source in self.ties.items() if source in d}}
                          for d in directions]
            columns = [[{name: d[_key(prefix, name)] for name in names if _key(prefix, name) in d}
                        for prefix, names in zip(self.prefixes, self.part_params)]
                       for d in directions]
            moving = [k for k in range(self.depth) if any(c[k] for c in columns)]
            if not moving:
                return [{} for _ in columns]
            lowest = moving[0]
        if keep is not None and keep.get("lowest") == lowest:
            saved = keep["saved"]
        else:
            saved = self._saved(self._layers(params), X, lowest)
            if keep is not None:
                keep.update(lowest=lowest, saved=saved)
        results = []
        for j, column in enumerate(columns):
            last = j == len(columns) - 1 and keep is None  # its forward values then freed
            tangent = column if per_sample else None
            top = self.depth - 1
            for k in range(lowest, self.depth):
                # the sweep down reads a part's inner tangents for an HVP, and for a
                # Gauss–Newton product only at the top (below it: transposed Jacobians)
                tangent = self.modules[k].jvp_saved(saved[k], None if per_sample else column[k],
                                                    tangent, keep_inner=kind == "hvp" or k == top)
            products: list = [None] * self.depth
            if kind == "hvp":
                down, cotangent = None, target
                for k in range(top, lowest - 1, -1):
                    products[k], down, cotangent = self.modules[k].hvp_saved(
                        saved[k], cotangent, down, out=self._part_out(k, outs[j]))
                    saved[k] = None if last else saved[k]
            else:
                products[top], down = self.modules[top].gnvp_saved(
                    saved[top], target, out=self._part_out(top, outs[j]))
                for k in range(top - 1, lowest - 1, -1):
                    products[k], down = self.modules[k].vjp_saved(
                        saved[k], down, out=self._part_out(k, outs[j]))
                    saved[k] = None if last else saved[k]
            results.append(down if per_sample else self._folded(
                {_key(self.prefixes[k], name): products[k][name]
                 for k in range(lowest, self.depth) for name in column[k]}, outs[j]))
        return results

    def _product(self, kind: str, params: dict[str, Array], X: Array, target: Array,
                 v: Array, wrt: str | list[str] | None) -> Array:
        """:meth:`product_pieces` for ``v`` over ``wrt``, concatenated and checked."""
        single = len(X.shape) == len(self.modules[0].INPUT_SHAPE)
        if single:
            X, target = X[None], target[None]
        name = "Hessian" if kind == "hvp" else "Gauss–Newton"
        quantity = f"{kind}: the {name}-vector product"
        if isinstance(wrt, str) and wrt == "X":  # per sample, a direction in each input
            n = int(np.prod(X.shape[1:]))
            expected = (n,) if single else (X.shape[0], n)
            if tuple(v.shape) != expected:
                raise ValueError(f"v: expected shape {expected} (the input's vec_r per "
                                 f"sample), got shape {tuple(v.shape)}")
            down = self.product_pieces(kind, params, X, target, v.reshape(X.shape))[0]
            value = down.reshape(X.shape[0], -1)
            return self._finished(value[0] if single else value, X, quantity)
        chosen = [_key(prefix, n) for prefix, part
                  in zip(self.prefixes, self._chosen(wrt, tied=False))
                  for n in part]  # checked, in PARAMS order
        shapes = [tuple(params[name].shape) for name in chosen]
        sizes = [int(np.prod(shape)) for shape in shapes]
        if getattr(v, "ndim", 1) not in (1, 2) or tuple(v.shape[:1]) != (sum(sizes),):
            raise ValueError(f"v: expected shape ({sum(sizes)},) or ({sum(sizes)}, k) (the "
                             f"vec_r of the wrt parameters concatenated), got shape "
                             f"{tuple(v.shape)}")
        matrix = v.ndim == 2
        directions = []
        for column in ([v[:, j] for j in range(v.shape[1])] if matrix else [v]):
            offsets = np.cumsum([0, *sizes])
            directions.append({name: column[offsets[i]:offsets[i + 1]].reshape(shape)
                               for i, (name, shape) in enumerate(zip(chosen, shapes))})
        if matrix:
            results = [self._cat([pieces[name].reshape(-1) for name in chosen])
                       for pieces in self.product_pieces(kind, params, X, target, directions)]
            value = torch.stack(results, 1) if self.backend == "torch" else np.stack(results, 1)
            return self._finished(value, X, quantity)
        value, out = self._flat_out(params, chosen, X)
        (pieces,) = self.product_pieces(kind, params, X, target, directions, out=[out])
        for name in chosen:
            written(out[name], pieces[name])
        return self._finished(value, X, quantity)

    @over_batches()
    def hvp(self, params: dict[str, Array], X: Array, target: Array, v: Array,
            wrt: str | list[str] | None = None) -> Array:
        """The loss Hessian over ``wrt`` (default: all of ``PARAMS``) times ``v`` (the
        ``wrt`` blocks of ``vec_r`` concatenated, in ``PARAMS`` order), shape ``(n,)``, or
        with ``wrt="X"`` per sample ``(B, n_X)`` for ``v`` of shape ``(B, n_X)``, without
        forming the Hessian (Pearlmutter's forward-over-reverse, one part at a time): one
        forward pass, then the tangents ``dZ_k`` up through each part from the lowest in
        ``wrt``, and down the cotangents ``g_k``, their tangents ``dg_k`` and the products.
        A matrix ``v`` of shape ``(n, k)`` gives the ``k`` products as columns, ``(n, k)``,
        sharing the forward pass and the adjoints."""
        return self._product("hvp", params, X, target, v, wrt)

    @over_batches()
    def gnvp(self, params: dict[str, Array], X: Array, target: Array, v: Array,
             wrt: str | list[str] | None = None) -> Array:
        """The Gauss–Newton part of the loss Hessian over ``wrt`` times ``v`` (shapes as for
        :meth:`hvp`), ``mean_b J_b^T (∂²ℓ_b/∂Z_N²) J_b v`` with ``J`` the whole model's
        Jacobian: ``J v`` up through each part, the top part's loss curvature, then the
        transposed Jacobians down (no second derivative of any part enters)."""
        return self._product("gnvp", params, X, target, v, wrt)


class Stack(Chain):
    """``depth`` blocks of ``config``, parameters ``"<layer>.<name>"`` (``"0.W_Q"``)."""

    def __init__(self, config: Config, depth: int) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth: expected an int >= 1, got {depth!r}")
        super().__init__([(str(k), config) for k in range(depth)])
        self.top = self.modules[-1]
        self.block_params = self.part_params[-1]
