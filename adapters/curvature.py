"""``curvgap.curvature(module)``: the contract's functions for a real module, read from what
its forward computes (:mod:`.trace`), in the module's own parameter order and layout.

The module is traced on the first call with each kind of inputs, its program derived and
generated once (cached on disk, :mod:`curvgap.codegen.cache`), and its weights read at every
call in their own layout (reshapes, no copies). Every function takes the module's inputs as
its forward does: ``X`` (its first input), then the target (and ``v``), then the module's
keyword inputs (``attention_mask=...``), which are read as constants. Rows and columns of
Hessians, entries of gradients and HVPs follow
``torch.cat([p.reshape(-1) for p in module.parameters()])`` (or, with ``wrt``, the named
parameters listed, in the module's order); parameters the output does not depend on have
exact zeros.

In place of ``X, T``, the averaging functions (``loss``, ``gradient``, ``loss_hessian``,
``hvp``, ``gnvp``, ``diagonal``) and ``hessian_operator`` take a dataset's batches (a
``DataLoader`` of ``(X, T)``) and give the mean over its samples, over every rank's shard
under ``torch.distributed`` (:mod:`curvgap.data`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from ..codegen.cache import module_for
from ..data import is_batches, over_batches, takes_batches
from ..derivations.losses import names as loss_names
from ..models import Chain
from ..models.arrays import overflowed, written
from ..models.diagonal import DiagonalCost
from ..models.memory import check_room
from ..operators.hessian import CurvatureOperator, part_product
from ..operators.kronecker import KroneckerSum, kronecker_block
from .fingerprint import fingerprint
from .narrowing import OwnForward, narrowing
from .trace import Call, Trace, constants, doubled, fits, signature, trace


def _batch_first(module: torch.nn.Module) -> bool:
    """Whether the module takes its batch first: torch's ``batch_first=False`` (on the module
    or on the attention inside it) says otherwise."""
    for sub in module.modules():
        if isinstance(getattr(sub, "batch_first", None), bool):
            return sub.batch_first
    return True


@dataclass
class _Read:
    """A module read for one kind of inputs: its trace, the module's name of each of the
    runners' parameters (in their order), each part's prefix in a chain, and the runners made
    so far by scope (:meth:`runner`)."""

    trace: Trace
    names: dict[str, str]
    prefixes: list[str]
    fused: bool = False
    runners: dict[str, ModuleType | Chain] = field(default_factory=dict)

    @property
    def chained(self) -> bool:
        return len(self.trace.programs) > 1

    def runner(self, scope: str = "products", chained: bool = False) -> ModuleType | Chain:
        """What computes this module's derivatives, derived for ``scope``, generated on first
        use: for ``"products"`` (loss, gradient, HVP and GN products) the chain of its parts'
        modules (one part or several); for ``"blocks"`` (Hessian blocks, Jacobians,
        diagonals too) the generated module of its one part, or the chain of its parts (of
        one part too when ``chained``: a diagonal in bounded memory)."""
        key = f"{scope} chained" if chained else scope
        if key not in self.runners:
            programs = [dataclasses.replace(p, scope=scope) for p in self.trace.programs]
            # the blocks' generated code takes views (as_strided at a storage offset) that
            # torch.compile cannot trace: they run unfused
            fused = self.fused and scope == "products"
            if self.fused and not fused:
                warnings.warn("fused=True: Hessian blocks, Jacobians and diagonals "
                              "(loss_hessian, diagonal, jacobian, kronecker_block) run unfused "
                              "(torch.compile cannot trace their generated code); the loss, "
                              "gradient and products stay fused", stacklevel=4)
            if len(programs) == 1 and scope != "products" and not chained:
                self.runners[key] = module_for(programs[0], fused=fused)
            else:
                self.runners[key] = Chain.generate([(prefix[:-1], program) for prefix, program
                                                    in zip(self.prefixes, programs)], fused=fused)
        return self.runners[key]


class Curvature:
    """Exact derivatives of ``loss(module(X, **inputs), T)`` (``"mse"``:
    ``F.mse_loss``, the mean over every entry; ``"cross_entropy"``: over the last axis of
    the output, targets the class indices). ``fused=True``: the generated code runs through
    ``torch.compile(fullgraph=True)``, its elementwise chains fused (compiled on the first call
    for each kind of inputs: about a minute at real size; faster calls after)."""

    def __init__(self, module: torch.nn.Module, loss: str = "mse", fused: bool = False) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got "
                            f"{type(module).__name__}")
        allowed = [n for n in loss_names() if n != "linear"]
        if loss not in allowed:
            raise ValueError(f"loss: expected one of {allowed}, got {loss!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused: expected True or False, got {fused!r}")
        self.module, self.loss_name, self.fused = module, loss, fused
        self._reads: dict[tuple, _Read] = {}
        #: what the last :meth:`diagonal` of a chain of parts cost
        #: (:class:`~curvgap.models.chain.DiagonalCost`; None for a single layer's)
        self.diagonal_cost: DiagonalCost | None = None
        self._fingerprint = ""
        self._follow()

    def _follow(self) -> None:
        """Read the module again when what its answers depend on changed since the last call
        (:func:`~.fingerprint.fingerprint`: its submodules, their code and attributes, its
        parameters, their ties and ``requires_grad``): never an answer for the old module."""
        current = fingerprint(self.module)
        if current == self._fingerprint:
            return
        self._reads.clear()
        self._own_forward = OwnForward()
        self._fingerprint = current
        self.batch_dim = 0 if _batch_first(self.module) else 1
        self.names = [name for name, _ in self.module.named_parameters()]

    # -- reading the module ----------------------------------------------------------------------
    def _prepared(self, X: Any, T: Any, inputs: dict) -> tuple:
        """``X`` and ``T`` checked and laid out batch first, the module read for this kind of
        inputs (traced on first use), and the parameters and constants its runner takes. ``X``
        is ``None`` when the input is given by keyword (``inputs_embeds=``)."""
        self._follow()
        keyword = None
        if X is None and "inputs_embeds" in inputs:
            keyword, inputs = "inputs_embeds", dict(inputs)
            X = inputs.pop("inputs_embeds")
        inputs = _without_cache(self.module, inputs)
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"X: expected a torch.Tensor (the module's first input; or None "
                            f"with inputs_embeds=...) or a dataset's batches of (X, T), got "
                            f"{type(X).__name__}")
        if X.is_complex() or X.dtype == torch.bool:
            raise TypeError(f"X: expected a floating-point tensor (the input the derivatives "
                            f"are taken through) or integer token ids, got dtype {X.dtype}")
        X, T, inputs = _checked(self.module, X, T, inputs, self.batch_dim, keyword)
        if X.ndim < 2 or X.shape[self.batch_dim] < 1:
            raise ValueError(f"X: expected a batch of samples along dimension "
                             f"{self.batch_dim}, got shape {tuple(X.shape)}")
        call = Call(keyword, self.batch_dim)
        key = signature(call, X, inputs)
        # a batch of one shows no batch axis to a trace: it is read (and its fixed sizes
        # checked) as the sample twice
        one = X.ndim > call.batch_dim and X.shape[call.batch_dim] == 1
        seen = (doubled(X, call.batch_dim), doubled(inputs, call.batch_dim)) if one else (
            X, inputs)
        if key not in self._reads or not fits(self._reads[key].trace, call, *seen):
            self._reads[key] = self._read(call, *seen)
        read = self._reads[key]
        _check_indices(read.trace, inputs)
        how = narrowing(self.module, X, read.trace.readings)
        if how is not None:
            self._own_forward.check(self.module, call, X, inputs,
                                    read.trace.readings[-1].batch_dim, how)
        values = constants(read.trace, self.module, call, X, inputs, _dims(read.trace, X))
        params = {name: self.module.get_parameter(source).detach()
                  for name, source in read.names.items()}
        for prefix, part in zip(read.prefixes, values):
            params.update({f"{prefix}{name}": value for name, value in part.items()})
        vocabulary = read.trace.readings[0].vocabulary
        if vocabulary is not None:  # token ids: their one-hot rows
            if X.numel() and (X.min() < 0 or X.max() >= vocabulary):
                raise ValueError(f"X: expected token ids in [0, {vocabulary}), got ids from "
                                 f"{int(X.min())} to {int(X.max())}")
            dtype = next(iter(params.values())).dtype
            ids, X = X, torch.nn.functional.one_hot(X, vocabulary).to(dtype)
            padding = read.trace.readings[0].padding
            if padding is not None:  # the padding id's rows: the table's row is a constant
                X = X * (ids != padding).unsqueeze(-1).to(dtype)
        if self.batch_dim:
            X = X.movedim(self.batch_dim, 0)
        batch = read.trace.readings[-1].batch_dim
        if isinstance(T, torch.Tensor) and batch and T.ndim > batch:
            T = T.movedim(batch, 0)
        return X, T, read, params

    def _read(self, call: Call, X: torch.Tensor, inputs: dict) -> _Read:
        start = time.perf_counter()
        traced = trace(self.module, call, X, inputs, self.loss_name)
        programs, paths = traced.programs, traced.paths
        prefixes = ([""] if len(programs) == 1 else
                    [f"{path or f'part{k}'}." for k, path in enumerate(paths)])
        read = _Read(traced, {}, prefixes, self.fused)
        read.runner("products")
        # each runner parameter by the module's own name of it (a tied weight has one)
        canonical = {id(p): n for n, p in self.module.named_parameters()}
        names = {}
        for prefix, path, reading in zip(prefixes, paths, traced.readings):
            for name, source in reading.params.items():
                source = f"{path}.{source}" if path else source
                names[f"{prefix}{name}"] = canonical[id(self.module.get_parameter(source))]
        generating = time.perf_counter() - start - traced.seconds
        if generating > 1:  # a new architecture (a cached one only loads)
            parts = f" ({len(set(programs))} distinct of {len(programs)} parts)" \
                if len(programs) > 1 else ""
            print(f"curvgap: read {type(self.module).__name__} in {traced.seconds:.1f} s and "
                  f"generated its module{'s' if parts else ''}{parts} in {generating:.1f} s "
                  "(once per architecture: cached on disk)", file=sys.stderr)
        read.names = names
        return read

    # -- parameters in the module's order -------------------------------------------------------
    def _wrt(self, wrt: Any) -> list[str]:
        """The module's parameters ``wrt`` names (default: all), checked, in the module's
        order."""
        self._follow()
        if wrt is None:
            return list(self.names)
        names = [wrt] if isinstance(wrt, str) else wrt
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"wrt: expected a parameter name, a list of names or 'X', got "
                            f"{wrt!r} ({type(wrt).__name__})")
        unknown = [n for n in names if n not in self.names]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(f"wrt: expected distinct names of the module's parameters (such "
                             f"as {self.names[:2]}) or 'X', got {list(names)}")
        chosen = set(names)
        return [n for n in self.names if n in chosen]

    def _pieces(self, read: _Read, names: list[str]) -> list[tuple[str, tuple[str, ...], int]]:
        """Per module parameter of ``names`` (in order): its name, the runner's names for it
        (none: the output does not depend on it; several: a tied weight read in several
        places, whose derivatives add up) and its number of entries."""
        ours: dict[str, tuple[str, ...]] = {}
        for name, source in read.names.items():
            ours[source] = (*ours.get(source, ()), name)
        return [(n, ours.get(n, ()), self.module.get_parameter(n).numel()) for n in names]

    @staticmethod
    def _used(read: _Read, pieces: list) -> list[str]:
        """The runner's parameters among ``pieces``, in the runner's order."""
        order = {name: k for k, name in enumerate(read.names)}
        return sorted((r for _, ours, _ in pieces for r in ours), key=order.get)

    @staticmethod
    def _same(pieces: list, used: list[str]) -> bool:
        """Whether ``pieces`` are the ``used`` parameters one to one, in order."""
        return [ours for _, ours, _ in pieces] == [(name,) for name in used]

    @classmethod
    def _spread(cls, values: torch.Tensor, pieces: list, used: list[str], axis: int = 0
                ) -> torch.Tensor:
        """``values`` (along ``axis``: the ``used`` parameters' entries, concatenated) in the
        order of ``pieces``: zeros where a piece is not used, the sum where it is used in
        several places."""
        if cls._same(pieces, used):
            return values
        sizes = {r: size for _, ours, size in pieces for r in ours}
        offsets, offset = {}, 0
        for name in used:
            offsets[name] = offset
            offset += sizes[name]
        parts = []
        for _, ours, size in pieces:
            if not ours:
                shape = list(values.shape)
                shape[axis] = size
                parts.append(values.new_zeros(shape))
            else:
                parts.append(sum(values.narrow(axis, offsets[r], size) for r in ours))
        return torch.cat(parts, axis)

    @staticmethod
    def _directions(v: torch.Tensor, pieces: list, params: dict) -> list[dict]:
        """Per column of ``v`` (one for a vector; entries of ``pieces`` in the module's order),
        the direction of each runner parameter: a view of ``v`` shaped as the parameter (a tied
        weight's for each place it is read)."""
        columns = [v] if v.ndim == 1 else [v[:, j] for j in range(v.shape[1])]
        directions = []
        for column in columns:
            direction, offset = {}, 0
            for _, ours, size in pieces:
                for name in ours:
                    direction[name] = column[offset:offset + size].reshape(params[name].shape)
                offset += size
            directions.append(direction)
        return directions

    @staticmethod
    def _empty(pieces: list, like: torch.Tensor, columns: int | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """An empty result over ``pieces`` (in the module's order) in ``like``'s dtype and
        device, ``(n,)``, or ``(n, columns)``; for ``(n,)``, the slice of each piece read in
        one place, by the runner's name: the runner writes its result there."""
        n = sum(size for *_, size in pieces)
        out = torch.empty((n,) if columns is None else (n, columns), dtype=like.dtype,
                          device=like.device)
        slots, offset = {}, 0
        for _, ours, size in pieces:
            if columns is None and len(ours) == 1:
                slots[ours[0]] = out[offset:offset + size]
            offset += size
        return out, slots

    @staticmethod
    def _assembled(out: torch.Tensor, columns: list[dict], pieces: list, quantity: str
                   ) -> torch.Tensor:
        """``out`` (from :meth:`_empty`) holding the runner's results (per column, runner name
        → array) in the module's order of ``pieces``: zeros where a piece is not used, the
        sum where a tied weight is read in several places, each result copied unless the
        runner wrote it there. FloatingPointError where it is not finite (every input was
        checked finite: the arithmetic overflowed)."""
        for j, values in enumerate(columns):
            column = out[:, j] if out.ndim == 2 else out
            offset = 0
            for _, ours, size in pieces:
                slot = column[offset:offset + size]
                if not ours:
                    slot.zero_()
                else:
                    written(slot, values[ours[0]])
                    for name in ours[1:]:
                        slot.add_(values[name].reshape(-1))
                offset += size
        if not math.isfinite(float(out.sum())) and not bool(torch.isfinite(out).all()):
            raise overflowed(quantity, out.dtype)
        return out

    @staticmethod
    def _untied(pieces: list, what: str) -> None:
        tied = [n for n, ours, _ in pieces if len(ours) > 1]
        if tied:
            raise NotImplementedError(
                f"{what}: {tied[0]} is a tied weight read in several places; its {what} needs "
                f"the blocks between those places: use loss_hessian(wrt={tied[0]!r}) (or "
                f"untie it)")

    def _room(self, X: Any, wrt: Any) -> None:
        """MemoryError before any work where the loss Hessian over ``wrt`` cannot fit."""
        like = next(self.module.parameters(), None)
        if like is None:
            return
        if isinstance(wrt, str) and wrt == "X":
            if not isinstance(X, torch.Tensor) or not X.is_floating_point() or X.ndim < 2:
                return
            batch = X.shape[self.batch_dim]
            n = X.numel() // max(batch, 1)
            needed, shape = batch * n * n * X.element_size(), f"({batch}, {n}, {n})"
        else:
            n = sum(self.module.get_parameter(name).numel() for name in self._wrt(wrt))
            needed, shape = n * n * like.element_size(), f"({n}, {n})"
        check_room(needed, like.device, f"loss_hessian: the {shape} Hessian",
                   "hessian_operator(X, T) (its products, for eigsh or CG), "
                   "loss_hessian(X, T, wrt=[...]) for the block of a few parameters, or "
                   "diagonal(X, T) for its diagonal (max_memory= bounds its work)")

    def _selection(self, read: _Read, wrt: Any) -> tuple[list, list[str], int]:
        pieces = self._pieces(read, self._wrt(wrt))
        return pieces, self._used(read, pieces), sum(size for *_, size in pieces)

    # -- the contract ---------------------------------------------------------------------------
    def forward(self, X: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The module's (first) output, computed by the generated code."""
        X, _, read, params = self._prepared(X, None, inputs)
        out = read.runner().forward(params, X)
        return out.movedim(0, read.trace.readings[-1].batch_dim)

    @over_batches(state=lambda self: self.module)
    def loss(self, X: torch.Tensor, T: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The loss, averaged over the batch (a scalar)."""
        X, T, read, params = self._prepared(X, T, inputs)
        return read.runner().loss(params, X, T)

    @over_batches(state=lambda self: self.module)
    def gradient(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                 **inputs: Any) -> torch.Tensor:
        """The loss's gradient over ``wrt`` (default: every parameter), ``(n,)`` in the
        module's order; ``wrt="X"``: per sample, ``(B, n_X)``."""
        X, T, read, params = self._prepared(X, T, inputs)
        if isinstance(wrt, str) and wrt == "X":
            return read.runner().gradient(params, X, T, wrt="X")
        pieces, used, n = self._selection(read, wrt)
        if not used:
            return X.new_zeros(n)
        out, slots = self._empty(pieces, X)
        values, _ = read.runner().gradient_pieces(params, X, T, out=slots)
        return self._assembled(out, [values], pieces, "gradient: the gradient")

    def jacobian(self, X: torch.Tensor, wrt: Any, **inputs: Any) -> torch.Tensor:
        """``∂vec(output)/∂vec(wrt)`` per sample, ``(B, n_out, n_wrt)``, columns in the module's
        layout of ``wrt`` (a parameter name, or ``"X"``)."""
        X, _, read, params = self._prepared(X, None, inputs)
        if isinstance(wrt, str) and wrt == "X":
            return read.runner("blocks").jacobian(params, X, "X")
        pieces, used, n = self._selection(read, wrt)
        blocks = [read.runner("blocks").jacobian(params, X, name) for name in used]
        if not blocks:
            outputs = read.runner().forward(params, X)[0].numel()
            return X.new_zeros(X.shape[0], outputs, n)
        return self._spread(torch.cat(blocks, -1), pieces, used, axis=-1)

    @over_batches(state=lambda self: self.module)
    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                     part: str = "full", **inputs: Any) -> torch.Tensor:
        """The loss Hessian over ``wrt`` (default: every parameter), ``(n, n)`` in the
        module's order, blocks between parts included; ``part`` ``"full"``,
        ``"gauss_newton"`` or ``"functional"``; ``wrt="X"``: per sample ``(B, n_X, n_X)``."""
        self._room(X, wrt)
        X, T, read, params = self._prepared(X, T, inputs)
        if isinstance(wrt, str) and wrt == "X":
            return read.runner("blocks").loss_hessian(params, X, T, wrt="X", part=part)
        pieces, used, n = self._selection(read, wrt)
        if not used:
            return X.new_zeros(n, n)
        H = read.runner("blocks").loss_hessian(params, X, T, wrt=used, part=part)
        return self._spread(self._spread(H, pieces, used, 0), pieces, used, 1)

    def loss_hessian_mixed(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                           part: str = "full", **inputs: Any) -> torch.Tensor:
        """Per sample, the loss Hessian between ``X`` and ``wrt`` (default: every parameter),
        ``(B, n_X, n)``, columns in the module's order."""
        X, T, read, params = self._prepared(X, T, inputs)
        pieces, used, n = self._selection(read, wrt)
        H = read.runner("blocks").loss_hessian_mixed(params, X, T, wrt=used, part=part)
        return self._spread(H, pieces, used, -1)

    @over_batches(state=lambda self: self.module)
    def hvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor, wrt: Any = None,
            **inputs: Any) -> torch.Tensor:
        """The loss Hessian over ``wrt`` times ``v`` (both in the module's order), ``(n,)``,
        or times each column of ``v`` ``(n, k)``; ``wrt="X"``: per sample."""
        return self._product("hvp", X, T, v, wrt, inputs)

    @over_batches(state=lambda self: self.module)
    def gnvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor, wrt: Any = None,
             **inputs: Any) -> torch.Tensor:
        """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` of the loss Hessian over ``wrt`` times
        ``v``, shapes as for :meth:`hvp`."""
        return self._product("gnvp", X, T, v, wrt, inputs)

    def _product(self, kind: str, X: Any, T: Any, v: Any, wrt: Any, inputs: dict) -> Any:
        v = _tensor(v, X)
        X, T, read, params = self._prepared(X, T, inputs)
        product = getattr(read.runner(), kind)
        if isinstance(wrt, str) and wrt == "X":
            return product(params, X, T, v, wrt="X")
        pieces, used, n = self._selection(read, wrt)
        if v.ndim not in (1, 2) or v.shape[0] != n or (v.ndim == 2 and v.shape[1] == 0):
            raise ValueError(f"v: expected shape ({n},) or ({n}, k) with k >= 1 (the entries "
                             f"of {wrt or 'every parameter'} in the module's order), got shape "
                             f"{tuple(v.shape)}")
        if not used:
            return torch.zeros_like(v)
        return self._applied(kind, read, params, X, T, v, pieces)

    def _applied(self, kind: str, read: _Read, params: dict, X: torch.Tensor, T: Any,
                 v: torch.Tensor, pieces: list, keep: dict | None = None) -> torch.Tensor:
        """``kind`` (``"hvp"``, ``"gnvp"``) of ``v`` (``(n,)`` or ``(n, k)``, the entries of
        ``pieces`` in the module's order): the directions read as views of ``v`` in the
        runner's parameters, the products written once in the module's order (``keep``: the
        forward values and adjoints kept between calls at one point, see
        :meth:`curvgap.models.Chain.product_pieces`)."""
        out, slots = self._empty(pieces, v, None if v.ndim == 1 else v.shape[1])
        values = read.runner().product_pieces(kind, params, X, T,
                                              self._directions(v, pieces, params), keep,
                                              out=[slots] if slots else None)
        name = "Hessian" if kind == "hvp" else "Gauss–Newton"
        return self._assembled(out, values, pieces, f"{kind}: the {name}-vector product")

    @over_batches(state=lambda self: self.module)
    def diagonal(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None, part: str = "full",
                 max_memory: int | None = None, chunk: int | None = None,
                 **inputs: Any) -> torch.Tensor:
        """The diagonal of :meth:`loss_hessian` without forming it, ``(n,)`` in the module's
        order; ``wrt="X"``: per sample ``(B, n_X)``. For a model read as several parts,
        ``max_memory`` (bytes, default 2 GiB) bounds what it holds at once: per sample the
        curvature ``M`` of a part's output (``(L·d)²``) is then never formed, its columns go
        through the model in chunks (``chunk`` fixes how many; see
        :meth:`curvgap.models.Chain.diagonal`); what it cost is kept in
        :attr:`diagonal_cost`. A single layer's diagonal is derived whole, or with
        ``max_memory`` or ``chunk`` given a few rows of each parameter at a time."""
        X, T, read, params = self._prepared(X, T, inputs)
        runner = read.runner("blocks")
        if not isinstance(runner, Chain) and (max_memory is not None or chunk is not None):
            runner = read.runner("blocks", chained=True)
        bounds = {} if not isinstance(runner, Chain) else {"max_memory": max_memory,
                                                           "chunk": chunk}
        if isinstance(wrt, str) and wrt == "X":
            value = runner.diagonal(params, X, T, wrt="X", part=part, **bounds)
        else:
            pieces, used, n = self._selection(read, wrt)
            if not used:
                return X.new_zeros(n)
            self._untied(pieces, "diagonal")
            value = self._spread(runner.diagonal(params, X, T, wrt=used, part=part, **bounds),
                                 pieces, used)
        self.diagonal_cost = runner.diagonal_cost if isinstance(runner, Chain) else None
        return value

    def kronecker_block(self, X: torch.Tensor, T: torch.Tensor, wrt_i: str,
                        wrt_j: str | None = None, part: str = "full",
                        **inputs: Any) -> KroneckerSum:
        """The loss-Hessian block ``(wrt_i, wrt_j)`` (``wrt_j`` default ``wrt_i``) as its
        Kronecker factors (:class:`~curvgap.operators.KroneckerSum`), where the block is
        exactly such a sum for this module (a single part's weight matrices, each read
        whole)."""
        X, T, read, params = self._prepared(X, T, inputs)
        self._untied(self._pieces(read, self._wrt(list(dict.fromkeys([wrt_i, wrt_j or wrt_i])))),
                     "kronecker_block")
        ours = {s: n for n, s in read.names.items()}
        first = ours.get(wrt_i)
        second = ours.get(wrt_i if wrt_j is None else wrt_j)
        module = read.runner("blocks")
        if read.chained or first is None or second is None or (
                first, second, part) not in module.STRUCTURED:
            blocks = ([] if read.chained else
                      [f"({read.names[v]}, {read.names[w]}, {p!r})"
                       for v, w, p in module.STRUCTURED])
            raise ValueError(f"wrt_i, wrt_j: expected a block that is exactly a sum of "
                             f"Kronecker products in this module ({', '.join(blocks) or 'none'}"
                             f"), got ({wrt_i}, {wrt_j or wrt_i}, {part!r})")
        return kronecker_block(module, params, X, T, first, second, part)

    @takes_batches
    def hessian_operator(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                         part: str = "full", **inputs: Any) -> CurvatureOperator:
        """The loss Hessian over ``wrt`` (its ``part``) as a linear operator in the module's
        order (:class:`~curvgap.operators.CurvatureOperator`), for scipy's and curvlinops'
        solvers and estimators. On one batch the weights are read now (a snapshot: later
        changes to the module do not reach it); over a dataset's batches every product is a
        pass over them (collective under ``torch.distributed``, see :mod:`curvgap.data`)."""
        names = self._wrt(wrt)
        n = sum(self.module.get_parameter(name).numel() for name in names)
        if is_batches(X):
            like = next(self.module.parameters())
            return CurvatureOperator(part_product(
                lambda V: self.hvp(X, V, wrt, **inputs),
                lambda V: self.gnvp(X, V, wrt, **inputs), part), n, like.dtype, like.device)
        X_, T_, read, params = self._prepared(X, T, inputs)
        params = {k: v.clone() for k, v in params.items()}  # the weights of now
        pieces = self._pieces(read, names)
        used = self._used(read, pieces)
        read.runner().loss(params, X_, T_)  # checks X and T now, not at the first product

        def product(kind: str):
            kept: dict = {}  # this point's forward values and adjoints, after one product

            def multiply(V: torch.Tensor) -> torch.Tensor:
                if not used:
                    return torch.zeros_like(V)
                return self._applied(kind, read, params, X_, T_, V, pieces, kept)
            return multiply

        return CurvatureOperator(part_product(product("hvp"), product("gnvp"), part), n,
                                 X_.dtype, X_.device)

    def latex(self, X: torch.Tensor, part: str | None = None, **inputs: Any) -> str:
        """The LaTeX document of what curvgap derived for this module with these inputs
        (every node of its forward pass, its first and second derivatives, the loss Hessian's
        blocks and the Hessian-vector products, in index form). For a model read as a chain
        of parts, the document of ``part`` (a block's path such as ``"layers.0"``; default the
        first block, or the first part)."""
        from ..codegen.backends.latex import document

        _, _, read, _ = self._prepared(X, None, inputs)
        paths = read.trace.paths
        if part is None:
            part = next((p for p in paths if p), paths[0])
        if part not in paths:
            raise ValueError(f"part: expected one of the module's parts {paths}, got {part!r}")
        program = read.trace.programs[paths.index(part)]
        name = _identifier(f"{type(self.module).__name__}_{part}" if part else
                           type(self.module).__name__)
        return document(dataclasses.replace(program, name=name, scope="blocks"))

    def layer_slices(self, wrt: Any = None) -> dict[str, slice]:
        """Where each of the module's parameters (``wrt``, default all) lies in the rows of
        ``loss_hessian`` and ``gradient``: name → slice."""
        slices, offset = {}, 0
        for name in self._wrt(wrt):
            size = self.module.get_parameter(name).numel()
            slices[name] = slice(offset, offset + size)
            offset += size
        return slices


def _without_cache(module: torch.nn.Module, inputs: dict) -> dict:
    """``inputs`` with ``use_cache=False`` where the module's forward takes ``use_cache`` and
    the call does not give it: a Hugging Face decoder called as it is returns a key-value
    cache besides its output, which the loss does not read and no trace can return."""
    if "use_cache" in inputs:
        return inputs
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return inputs
    return {**inputs, "use_cache": False} if "use_cache" in parameters else inputs


def _identifier(name: str) -> str:
    """``name`` as a Python identifier (it names a document)."""
    return re.sub(r"\W", "_", name)


def _tensor(v: Any, X: torch.Tensor) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"v: expected a torch.Tensor (of X's dtype and device), got "
                        f"{type(v).__name__}")
    _finite("v", v)
    return v.detach()


def _finite(name: str, value: torch.Tensor) -> None:
    """ValueError naming the first entry of ``value`` that is NaN or inf."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        at = tuple(int(i) for i in (~torch.isfinite(value)).nonzero()[0])
        what = "NaN" if bool(torch.isnan(value[at])) else "inf"
        raise ValueError(f"{name}: expected finite values, got {what} at index "
                         f"{at[0] if len(at) == 1 else at}")


#: keyword inputs with one entry per sample and position of X, ``(B, L)``
_PER_POSITION = ("attention_mask", "src_key_padding_mask", "key_padding_mask",
                 "tgt_key_padding_mask", "token_type_ids", "position_ids")


def _meta(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (cpu or cuda), got a meta "
                         f"tensor")


def _checked(module: torch.nn.Module, X: torch.Tensor, T: Any, inputs: dict, batch_dim: int,
             keyword: str | None) -> tuple[torch.Tensor, Any, dict]:
    """The call's inputs checked before any work (no meta tensors, token ids of shape
    ``(B, L)``, a batch of sequences, keyword inputs of X's batch and length) and detached
    (the derivatives do not depend on their autograd state); token ids as int64."""
    name = keyword or "X"
    _meta(name, X)  # (a meta target is refused by the loss, with its own words)
    for key, value in inputs.items():
        _meta(key, value)
    meta = next((n for n, p in module.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise ValueError(f"module: expected parameters with data (cpu or cuda), got a meta "
                         f"tensor for {meta!r} (materialise it: module.to_empty(device=...) "
                         f"and load its weights)")
    X = X.detach()
    T = T.detach() if isinstance(T, torch.Tensor) else T
    inputs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if not X.is_floating_point():
        if X.ndim > 2 and X.shape[-1] == 1:  # (B, L, 1)
            raise ValueError(f"{name}: expected token ids of shape (B, L), got shape "
                             f"{tuple(X.shape)}")
        X = X.long()
        batch, length = X.shape if X.ndim == 2 else (None, None)
    elif X.ndim == 3:
        batch, length = X.shape[batch_dim], X.shape[1 - batch_dim]
    else:
        batch = length = None
        if X.ndim == 2 and any(isinstance(m, torch.nn.MultiheadAttention)
                               for m in module.modules()):
            layout, one = ("(B, L, d)", "unsqueeze(0)") if batch_dim == 0 else (
                "(L, B, d)", "unsqueeze(1)")
            raise ValueError(f"{name}: expected shape {layout} (a batch of sequences; "
                             f"{type(module).__name__} reads a 2-D input as one sequence "
                             f"without a batch), got shape {tuple(X.shape)}; for one "
                             f"sequence pass {name}.{one}")
    if batch is not None and inputs.get("past_key_values") is None:
        for key in _PER_POSITION:
            value = inputs.get(key)
            if not isinstance(value, torch.Tensor) or value.ndim != 2:
                continue
            ones = key == "position_ids" and value.shape[0] == 1
            if value.shape[1] != length or (value.shape[0] != batch and not ones):
                also = f" or (1, {length})" if key == "position_ids" else ""
                raise ValueError(f"{key}: expected shape ({batch}, {length}){also} to match "
                                 f"{name}'s batch and sequence, got {tuple(value.shape)}")
    return X, T, inputs


def _check_indices(traced: Trace, inputs: dict) -> None:
    """ValueError naming a keyword input of indices into a table (``position_ids``) that
    has one outside the table."""
    for reading in traced.readings:
        for constant in reading.constants:
            kind, _, arg = constant.transform.partition(":")
            value = inputs.get(constant.node) if isinstance(constant.node, str) else None
            if kind not in ("one_hot", "index") or not isinstance(value, torch.Tensor) \
                    or not value.numel():
                continue
            rows = int(arg.partition(":")[0])
            low = -rows if kind == "index" else 0
            outside = (value < low) | (value >= rows)
            if bool(outside.any()):
                at = tuple(int(i) for i in outside.nonzero()[0])
                raise ValueError(f"{constant.node}: expected indices in [{low}, {rows}) (the "
                                 f"module's table has {rows} rows), got {int(value[at])} at "
                                 f"index {at[0] if len(at) == 1 else at}")


def _dims(traced: Trace, X: torch.Tensor) -> list[dict[str, int]]:
    """Each part's sizes for this ``X``: the fixed ones and those bound at call time (the
    trace's symbols, valued from ``X``'s shape)."""
    placeholder = next(n for n in traced.exported.graph.nodes if n.name == traced.X)
    values = {}
    for extent, size in zip(placeholder.meta["val"].shape, X.shape):
        if isinstance(extent, torch.SymInt):
            values[extent.node.expr] = int(size)
    out = []
    for reading in traced.readings:
        dims = {name: size for name, size in reading.program.sizes if size is not None}
        for name, symbol in reading.symbols.items():
            dims[name] = int(symbol.xreplace(values))
        out.append(dims)
    return out
