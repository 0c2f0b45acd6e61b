"""``curvgap.curvature(module)``: the contract's functions for a real module, read from what
its forward computes (:mod:`.trace`), in the module's own parameter order and layout.

The module is traced on the first call with each kind of inputs, its program derived and
generated once (cached on disk, :mod:`curvgap.codegen.cache`), and its weights read at every
call in their own layout (reshapes, no copies). Every function takes the module's inputs as
its forward does: ``X`` (its first input), then the target (and ``v``), then the module's
keyword inputs (``attention_mask=...``), which are read as constants. Rows and columns of
Hessians, entries of gradients and HVPs follow
``torch.cat([p.reshape(-1) for p in module.parameters() if p.requires_grad])`` (or, with
``wrt``, the parameters listed, by name or as objects, in the order given); parameters the
output does not depend on have exact zeros.

In place of ``X, T``, the averaging functions (``loss``, ``gradient``, ``loss_hessian``,
``hvp``, ``gnvp``, ``diagonal``, ``hessian_trace``) and ``hessian_operator`` take a
dataset's batches (a ``DataLoader`` of ``(X, T)``) and give the mean over its samples, over
every rank's shard under ``torch.distributed`` (:mod:`curvgap.data`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..codegen.cache import announced, say
from ..data import is_batches, one_batch, over_batches, takes_batches
from ..derivations.losses import names as loss_names
from ..models import Chain
from ..models.diagonal import DiagonalCost
from ..models.memory import check_room
from ..operators.hessian import CurvatureOperator, part_product
from ..operators.kronecker import KroneckerSum, kronecker_block
from ..runtime.loading import checks
from .fingerprint import fingerprint
from .inputs import (
    IGNORE_INDEX,
    batch_first,
    by_name,
    check_indices,
    checked,
    direction,
    ignored_scale,
    part_dims,
    unpacked,
    without_cache,
)
from .narrowing import OwnForward, narrowing
from .pieces import assembled, directions, empty, pieces_of, refuse_tied, spread, used_of
from .readings import load_reading, reading_key, store_reading
from .trace import Call, constants, doubled, fits, signature, trace
from .traced import Traced

#: a dataset's batches in place of ``X, T``: the mean over them, each weighed by its terms
_over_dataset = over_batches(state=lambda c: c.module, count_of=lambda c, X, T: c._terms())


class Curvature:
    """Exact derivatives of ``loss(module(X, **inputs), T)`` (``"mse"``:
    ``F.mse_loss``, the mean over every entry; ``"cross_entropy"``: ``F.cross_entropy`` over
    the last axis of the output, the targets class indices, ``-100`` ignored, the mean over
    the targets counted). ``fused=True``: the generated code runs through
    ``torch.compile(fullgraph=True)``, its elementwise chains fused (compiled on the first call
    for each kind of inputs: about a minute at real size; faster calls after)."""

    def __init__(self, module: torch.nn.Module, loss: str = "mse", fused: bool = False) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got "
                            f"{type(module).__name__}")
        allowed = [n for n in loss_names() if n != "linear"] + ["model"]
        if loss not in allowed:
            raise ValueError(f"loss: expected one of {allowed}, got {loss!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused: expected True or False, got {fused!r}")
        self.module, self.loss_name, self.fused = module, loss, fused
        self._traced: dict[tuple, Traced] = {}
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
        self._traced.clear()
        self._own_forward = OwnForward()
        self._fingerprint = current
        self.batch_dim = 0 if batch_first(self.module) else 1
        self.names = [name for name, _ in self.module.named_parameters()]

    # -- reading the module ----------------------------------------------------------------------
    def _prepared(self, X: Any, T: Any, inputs: dict, needs_target: bool = True) -> tuple:
        """``X`` and ``T`` checked and laid out batch first, the module read for this kind of
        inputs (traced on first use), and the parameters and constants its runner takes. ``X``
        is ``None`` when the input is given by keyword (``inputs_embeds=``); a dict batch
        holds a target only where the call ``needs_target``."""
        self._follow()
        arguments = (X, T, inputs, needs_target)
        if isinstance(X, dict):
            X, T, inputs = unpacked(self.module, X, T, inputs, self.loss_name, needs_target)
        keyword = None
        if X is None and "inputs_embeds" in inputs:
            keyword, inputs = "inputs_embeds", dict(inputs)
            X = inputs.pop("inputs_embeds")
        inputs = without_cache(self.module, inputs)
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"X: expected a torch.Tensor (the module's first input; or None "
                            f"with inputs_embeds=...) or a dataset's batches of (X, T), got "
                            f"{type(X).__name__}")
        if X.is_complex() or X.dtype == torch.bool:
            raise TypeError(f"X: expected a floating-point tensor (the input the derivatives "
                            f"are taken through) or integer token ids, got dtype {X.dtype}")
        X, T, inputs = checked(self.module, X, T, inputs, self.batch_dim, keyword)
        given = X
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
        if key not in self._traced or not fits(self._traced[key].trace, call, *seen):
            self._traced[key] = self._trace(call, *seen)
        traced = self._traced[key]
        check_indices(traced.trace, inputs)
        how = narrowing(self.module, X, traced.trace.readings)
        if how is not None:
            self._own_forward.check(self.module, call, X, inputs,
                                    traced.trace.readings[-1].batch_dim, how)
        values, own = constants(traced.trace, self.module, call, X, inputs,
                                part_dims(traced.trace, X))
        T = self._target_of(T, own, traced)
        params = {name: self.module.get_parameter(source).detach()
                  for name, source in traced.names.items()}
        for prefix, part in zip(traced.prefixes, values):
            params.update({f"{prefix}{name}": value for name, value in part.items()})
        vocabulary = traced.trace.readings[0].vocabulary
        if vocabulary is not None:  # token ids: their one-hot rows
            if X.numel() and (X.min() < 0 or X.max() >= vocabulary):
                raise ValueError(f"X: expected token ids in [0, {vocabulary}), got ids from "
                                 f"{int(X.min())} to {int(X.max())}")
            dtype = next(iter(params.values())).dtype
            # the padding id's rows are zeros: the table's row there is a constant
            padding = traced.trace.readings[0].padding
            kept = (X != padding if padding is not None else torch.ones_like(X)).to(dtype)
            X = torch.zeros(*X.shape, vocabulary, dtype=dtype, device=X.device).scatter_(
                -1, X.unsqueeze(-1), kept.unsqueeze(-1))
        if self.batch_dim:
            X = X.movedim(self.batch_dim, 0)
        batch = traced.trace.readings[-1].batch_dim
        if isinstance(T, torch.Tensor) and batch and T.ndim > batch:
            T = T.movedim(batch, 0)
        if traced.from_disk:  # checked once against the module itself
            traced.from_disk = False
            if not self._agrees(traced, call, given, inputs, X, T, params):
                self._traced[key] = self._trace(call, *seen, fresh=True)
                return self._prepared(*arguments)
        return X, T, traced, params

    def _agrees(self, traced: Traced, call: Call, given: torch.Tensor, inputs: dict,
                X: torch.Tensor, T: Any, params: dict) -> bool:
        """Whether a reading loaded from disk computes what the module does on this batch:
        its output (its loss, for the model's own) within a thousandth of the module's own
        largest entry (a stale reading differs in its leading digits)."""
        args, kw = call.arguments(given, inputs)
        with torch.enable_grad():  # the path the trace read (no inference-only kernels)
            out = self.module(*args, **kw)
        theirs = next((leaf for leaf in pytree.tree_leaves(out)
                       if isinstance(leaf, torch.Tensor)), None)
        if traced.trace.own is not None:
            ours = self._mean(traced.runner().loss(params, X, T), T)
        else:
            ours = traced.runner().forward(params, X).movedim(
                0, traced.trace.readings[-1].batch_dim)
        if theirs is None or ours.shape != theirs.shape:
            return False
        theirs = theirs.detach().to(ours.dtype)
        tolerance = max(1e-3, 10 * torch.finfo(ours.dtype).eps)
        return bool((ours - theirs).abs().max() <= tolerance * theirs.abs().max().clamp_min(1))

    def _target_of(self, T: Any, own: torch.Tensor | None, traced: Traced) -> Any:
        """The target of this call: ``T`` as given, or the one the model made for its own
        loss (``loss="model"``); kept, with the loss it is read by, for :meth:`_terms`."""
        if self.loss_name == "model" and T is not None:
            raise TypeError(f"T: expected None with loss='model' (the model makes its target "
                            f"from the inputs it takes, labels=...), got "
                            f"{type(T).__name__}")
        if own is not None:
            T = own
        self._target = T
        self._kind = traced.trace.own.kind if traced.trace.own is not None else self.loss_name
        return T

    def _trace(self, call: Call, X: torch.Tensor, inputs: dict, fresh: bool = False) -> Traced:
        """The module read for this kind of inputs: from disk (checked against the module on
        first use), or traced (``fresh``: always) and kept on disk."""
        start = time.perf_counter()
        key = reading_key(self.module, signature(call, X, inputs), self.loss_name)
        found = None if fresh else load_reading(key)
        tracing = 0.0
        if found is None or not fits(found, call, X, inputs):
            with announced(f"reading {type(self.module).__name__}'s forward for these kinds "
                           "of inputs (torch.export; kept on disk)"):
                found = trace(self.module, call, X, inputs, self.loss_name)
            tracing = found.seconds
            store_reading(key, found)
        programs, paths = found.programs, found.paths
        prefixes = ([""] if len(programs) == 1 else
                    [f"{path or f'part{k}'}." for k, path in enumerate(paths)])
        if not any(program.params for program in programs):
            raise ValueError(f"module: expected parameters that require a gradient (the "
                             f"variables curvgap differentiates by, as autograd does), but "
                             f"{type(self.module).__name__}'s output reads none that does; "
                             f"thaw some with requires_grad_(True) (a module with none is "
                             f"not read, even for derivatives in X)")
        traced = Traced(found, {}, prefixes, self.fused, from_disk=tracing == 0.0)
        traced.runner("products")
        # each runner parameter by the module's own name of it (a tied weight has one)
        canonical = {id(p): n for n, p in self.module.named_parameters()}
        names = {}
        for prefix, path, reading in zip(prefixes, paths, found.readings):
            for name, source in reading.params.items():
                source = f"{path}.{source}" if path else source
                names[f"{prefix}{name}"] = canonical[id(self.module.get_parameter(source))]
        generating = time.perf_counter() - start - tracing
        if generating > 1:  # a new architecture (a cached one only loads)
            parts = f" ({len(set(programs))} distinct of {len(programs)} parts)" \
                if len(programs) > 1 else ""
            say(f"generated {type(self.module).__name__}'s module{'s' if parts else ''}"
                f"{parts} in {generating:.1f} s (once per architecture: cached on disk)")
        traced.names = names
        return traced

    # -- the variables: the module's parameters ----------------------------------------------
    def _wrt(self, wrt: Any) -> list[str]:
        """The module's parameters ``wrt`` gives (names, aliases of a tied weight or the
        ``Parameter`` objects themselves, each requiring a gradient; default: all those that
        require one, in the module's order), checked, as names in the order given."""
        self._follow()
        if wrt is None:
            names = [n for n in self.names if self.module.get_parameter(n).requires_grad]
            if not names and self.names:
                raise ValueError(f"wrt: expected parameters to differentiate by, but none of "
                                 f"{type(self.module).__name__}'s requires a gradient (all "
                                 f"frozen); name them: wrt=[...]")
        else:
            # checked as a generated module checks it
            names = checks("torch")._check_wrt(by_name(self.module, wrt), self.names)
            frozen = [n for n in names if n != "X" and
                      not self.module.get_parameter(n).requires_grad]
            if frozen:
                raise ValueError(f"wrt: expected parameters that require a gradient (autograd's "
                                 f"variables), got {frozen[0]!r}, which is frozen; thaw it with "
                                 f"requires_grad_(True) to differentiate by it")
        if names in (["X"], []):
            raise ValueError("wrt: expected names of the module's parameters here ('X' alone "
                             "is taken by gradient, jacobian, loss_hessian, diagonal, hvp and "
                             "gnvp), got 'X'" if names else
                             f"wrt: {type(self.module).__name__} has no parameters")
        return names

    def _to_input(self, traced: Traced, wrt: Any) -> bool:
        """Whether ``wrt`` is ``"X"`` (per-sample derivatives in the input); refused where
        the input is token ids."""
        if not (isinstance(wrt, str) and wrt == "X"):
            return False
        if traced.trace.readings[0].vocabulary is not None:
            raise ValueError(f"wrt: expected names of {type(self.module).__name__}'s "
                             f"parameters, got 'X': its input is token ids, data and not a "
                             f"variable (autograd takes no derivative in integer ids either); "
                             f"pass the embedded rows instead (inputs_embeds=... for a Hugging "
                             f"Face model) for derivatives in the input")
        return True

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

    def _terms(self) -> int:
        """The terms the loss of the batch just computed is the mean over (a dataset's
        batches weigh by them): its targets counted for a cross-entropy (``-100`` ignored),
        the output's entries otherwise."""
        T = self._target  # a tensor: counted where it is (no factory under a device context)
        T = T if isinstance(T, torch.Tensor) else torch.as_tensor(T)
        return int((T != IGNORE_INDEX).sum()) if self._kind == "cross_entropy" else T.numel()

    def _mean(self, value: torch.Tensor, T: Any, per_sample: bool = False) -> torch.Tensor:
        """``value`` (the loss or a derivative of it over the batch; ``per_sample``: one per
        sample along its first axis) as torch's mean over the targets counted where some are
        ignored (:func:`~.inputs.ignored_scale`); as it is otherwise."""
        scale = ignored_scale(T, self._kind, per_sample)
        if scale is None:
            return value
        if isinstance(scale, torch.Tensor):
            return value * scale.to(value.dtype).reshape(-1, *[1] * (value.ndim - 1))
        return value * scale

    def _selection(self, traced: Traced, wrt: Any) -> tuple[list, list[str], int]:
        pieces = pieces_of(self.module, traced, self._wrt(wrt))
        return pieces, used_of(traced, pieces), sum(size for *_, size in pieces)

    # -- the contract ---------------------------------------------------------------------------
    def forward(self, X: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The module's (first) output, computed by the generated code."""
        X, _, traced, params = self._prepared(X, None, inputs, needs_target=False)
        out = traced.runner().forward(params, X)
        return out.movedim(0, traced.trace.readings[-1].batch_dim)

    @_over_dataset
    def loss(self, X: torch.Tensor, T: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The loss, averaged over the batch (a scalar)."""
        X, T, traced, params = self._prepared(X, T, inputs)
        return self._mean(traced.runner().loss(params, X, T), T)

    @_over_dataset
    def gradient(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                 **inputs: Any) -> torch.Tensor:
        """The loss's gradient over ``wrt`` (default: every parameter that requires a
        gradient), ``(n,)`` in the order of ``wrt``; ``wrt="X"``: per sample, ``(B, n_X)``."""
        X, T, traced, params = self._prepared(X, T, inputs)
        if self._to_input(traced, wrt):
            return self._mean(traced.runner().gradient(params, X, T, wrt="X"), T, True)
        pieces, used, n = self._selection(traced, wrt)
        if not used:
            return X.new_zeros(n)
        out, slots = empty(pieces, X)
        values, _ = traced.runner().gradient_pieces(params, X, T, out=slots)
        return self._mean(assembled(out, [values], pieces, "gradient", "the gradient", X), T)

    def jacobian(self, X: torch.Tensor, wrt: Any, **inputs: Any) -> torch.Tensor:
        """``∂vec(output)/∂vec(wrt)`` per sample, ``(B, n_out, n_wrt)``, columns over ``wrt``
        (parameters, each in its own layout, in the order given; or ``"X"``)."""
        X, _, traced, params = self._prepared(X, None, inputs, needs_target=False)
        if self._to_input(traced, wrt):
            return traced.runner("blocks").jacobian(params, X, "X")
        pieces, used, n = self._selection(traced, wrt)
        blocks = [traced.runner("blocks").jacobian(params, X, name) for name in used]
        if not blocks:
            outputs = traced.runner().forward(params, X)[0].numel()
            return X.new_zeros(X.shape[0], outputs, n)
        return spread(torch.cat(blocks, -1), pieces, used, axis=-1)

    @_over_dataset
    def loss_hessian(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                     part: str = "full", **inputs: Any) -> torch.Tensor:
        """The loss Hessian over ``wrt`` (default: every parameter that requires a
        gradient), ``(n, n)`` in the order of ``wrt``, blocks between parts included;
        ``part`` ``"full"``, ``"gauss_newton"`` or ``"functional"``; ``wrt="X"``: per
        sample ``(B, n_X, n_X)``."""
        self._room(X, wrt)
        X, T, traced, params = self._prepared(X, T, inputs)
        if self._to_input(traced, wrt):
            return self._mean(traced.runner("blocks").loss_hessian(params, X, T, wrt="X",
                                                                   part=part), T, True)
        pieces, used, n = self._selection(traced, wrt)
        if not used:
            return X.new_zeros(n, n)
        H = traced.runner("blocks").loss_hessian(params, X, T, wrt=used, part=part)
        return self._mean(spread(spread(H, pieces, used, 0), pieces, used, 1), T)

    @one_batch
    def loss_hessian_mixed(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                           part: str = "full", **inputs: Any) -> torch.Tensor:
        """Per sample, the loss Hessian between ``X`` and ``wrt`` (default: every parameter
        that requires a gradient), ``(B, n_X, n)``, columns in the order of ``wrt``."""
        X, T, traced, params = self._prepared(X, T, inputs)
        self._to_input(traced, "X")  # refused for token ids, which are data
        pieces, used, n = self._selection(traced, wrt)
        H = traced.runner("blocks").loss_hessian_mixed(params, X, T, wrt=used, part=part)
        return self._mean(spread(H, pieces, used, -1), T, True)

    @_over_dataset
    def hvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor, wrt: Any = None,
            **inputs: Any) -> torch.Tensor:
        """The loss Hessian over ``wrt`` times ``v`` (both in the order of ``wrt``), ``(n,)``,
        or times each column of ``v`` ``(n, k)``; ``wrt="X"``: per sample."""
        return self._product("hvp", X, T, v, wrt, inputs)

    @_over_dataset
    def gnvp(self, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor, wrt: Any = None,
             **inputs: Any) -> torch.Tensor:
        """The Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` of the loss Hessian over ``wrt`` times
        ``v``, shapes as for :meth:`hvp`."""
        return self._product("gnvp", X, T, v, wrt, inputs)

    def _product(self, kind: str, X: Any, T: Any, v: Any, wrt: Any, inputs: dict) -> Any:
        X, T, traced, params = self._prepared(X, T, inputs)
        product = getattr(traced.runner(), kind)
        if self._to_input(traced, wrt):
            return self._mean(product(params, X, T, direction(v, X), wrt="X"), T, True)
        v = direction(v, next(self.module.parameters()))
        pieces, used, n = self._selection(traced, wrt)
        if not used:
            directions(v, pieces, params)  # checked all the same
            return torch.zeros_like(v)
        return self._mean(self._applied(kind, traced, params, X, T, v, pieces), T)

    def _applied(self, kind: str, traced: Traced, params: dict, X: torch.Tensor, T: Any,
                 v: torch.Tensor, pieces: list, keep: dict | None = None) -> torch.Tensor:
        """``kind`` (``"hvp"``, ``"gnvp"``) of ``v`` (``(n,)`` or ``(n, k)``, the entries of
        ``pieces`` in the order of ``wrt``): the directions read as views of ``v`` in the
        runner's parameters, the products written once in that order (``keep``: the
        forward values and adjoints kept between calls at one point, see
        :meth:`curvgap.models.Chain.product_pieces`)."""
        out, slots = empty(pieces, v, None if v.ndim == 1 else v.shape[1])
        values = traced.runner().product_pieces(kind, params, X, T,
                                              directions(v, pieces, params), keep,
                                              out=[slots] if slots else None)
        name = "Hessian" if kind == "hvp" else "Gauss–Newton"
        return assembled(out, values, pieces, kind, f"the {name}-vector product", X)

    @_over_dataset
    def diagonal(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None, part: str = "full",
                 max_memory: int | None = None, chunk: int | None = None,
                 max_seconds: float | None = None, **inputs: Any) -> torch.Tensor:
        """The diagonal of :meth:`loss_hessian` without forming it, ``(n,)`` in the module's
        order; ``wrt="X"``: per sample ``(B, n_X)``. For a model read as several parts,
        ``max_memory`` (bytes, default 2 GiB) bounds what it holds at once: per sample the
        curvature ``M`` of a part's output (``(L·d)²``) is then never formed, its columns go
        through the model in chunks (``chunk`` fixes how many; see
        :meth:`curvgap.models.Chain.diagonal`); what it cost is kept in
        :attr:`diagonal_cost`. Its time and memory are estimated from its first chunks (said
        where it takes 5 s or more); past ``max_seconds`` it stops there with a
        ``TimeoutError`` naming the estimate and the cheaper routes (the limit holds for each batch
        of a loader, and for each of the two diagonals ``part="functional"`` takes). A single
        layer's diagonal is derived whole, or with ``max_memory``, ``chunk`` or ``max_seconds``
        given a few rows of each parameter at a time. A weight tied across parts (a language model's
        head and token table) has its exact diagonal, the blocks between its places included (the
        chunked route)."""
        X, T, traced, params = self._prepared(X, T, inputs)
        runner = traced.runner("blocks")
        given = {"max_memory": max_memory, "chunk": chunk, "max_seconds": max_seconds}
        if not isinstance(runner, Chain) and any(v is not None for v in given.values()):
            runner = traced.runner("blocks", chained=True)
        bounds = given if isinstance(runner, Chain) else {}
        if self._to_input(traced, wrt):
            value = self._mean(runner.diagonal(params, X, T, wrt="X", part=part, **bounds), T,
                               True)
        else:
            pieces, used, n = self._selection(traced, wrt)
            if not used:
                return X.new_zeros(n)
            tied = [list(ours) for _, ours, _ in pieces if len(ours) > 1]
            if tied and not isinstance(runner, Chain):  # read twice in one part
                refuse_tied(pieces, "diagonal")
            shared = {"shared": tied} if tied else {}
            value = self._mean(spread(runner.diagonal(params, X, T, wrt=used, part=part,
                                                      **bounds, **shared), pieces, used), T)
        self.diagonal_cost = runner.diagonal_cost if isinstance(runner, Chain) else None
        return value

    @_over_dataset
    def hessian_trace(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                      part: str = "full", max_memory: int | None = None,
                      chunk: int | None = None, max_seconds: float | None = None,
                      **inputs: Any) -> torch.Tensor:
        """The trace of :meth:`loss_hessian` over ``wrt`` (default: as for it), a
        scalar, summed from its exact :meth:`diagonal` (the Hessian never formed; what a
        Hutchinson estimate approximates); with ``wrt="X"`` per sample, ``(B,)``."""
        diagonal = self.diagonal(X, T, wrt, part, max_memory, chunk, max_seconds, **inputs)
        return checks("torch")._trace_of(diagonal, "hessian_trace")

    @one_batch
    def kronecker_block(self, X: torch.Tensor, T: torch.Tensor, wrt_i: str,
                        wrt_j: str | None = None, part: str = "full",
                        **inputs: Any) -> KroneckerSum:
        """The loss-Hessian block ``(wrt_i, wrt_j)`` (``wrt_j`` default ``wrt_i``) as its
        Kronecker factors (:class:`~curvgap.operators.KroneckerSum`), where the block is
        exactly such a sum for this module (a single part's weight matrices, each read
        whole)."""
        X, T, traced, params = self._prepared(X, T, inputs)
        wrt = self._wrt(list(dict.fromkeys([wrt_i, wrt_j or wrt_i])))
        refuse_tied(pieces_of(self.module, traced, wrt), "kronecker_block")
        ours = {s: n for n, s in traced.names.items()}
        first = ours.get(wrt_i)
        second = ours.get(wrt_i if wrt_j is None else wrt_j)
        module = traced.runner("blocks")
        if traced.chained or first is None or second is None or (
                first, second, part) not in module.STRUCTURED:
            blocks = ([] if traced.chained else
                      [f"({traced.names[v]}, {traced.names[w]}, {p!r})"
                       for v, w, p in module.STRUCTURED])
            raise ValueError(f"wrt_i, wrt_j: expected a block that is exactly a sum of "
                             f"Kronecker products in this module ({', '.join(blocks) or 'none'}"
                             f"), got ({wrt_i}, {wrt_j or wrt_i}, {part!r})")
        return kronecker_block(module, params, X, T, first, second, part)

    @takes_batches
    def hessian_operator(self, X: torch.Tensor, T: torch.Tensor, wrt: Any = None,
                         part: str = "full", **inputs: Any) -> CurvatureOperator:
        """The loss Hessian over ``wrt`` (its ``part``) as a linear operator in the order of
        ``wrt`` (:class:`~curvgap.operators.CurvatureOperator`), for scipy's and curvlinops'
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
        X_, T_, traced, params = self._prepared(X, T, inputs)
        params = {k: v.clone() for k, v in params.items()}  # the weights of now
        pieces = pieces_of(self.module, traced, names)
        used = used_of(traced, pieces)
        traced.runner().loss(params, X_, T_)  # checks X and T now, not at the first product
        ignored_scale(T_, self._kind)  # and that some target counts

        def product(kind: str):
            kept: dict = {}  # this point's forward values and adjoints, after one product

            def multiply(V: torch.Tensor) -> torch.Tensor:
                if not used:
                    return torch.zeros_like(V)
                return self._mean(self._applied(kind, traced, params, X_, T_, V, pieces, kept),
                                  T_)
            return multiply

        return CurvatureOperator(part_product(product("hvp"), product("gnvp"), part), n,
                                 X_.dtype, X_.device)

    def latex(self, X: torch.Tensor, part: str | None = None,
              names: dict[str, str | int] | None = None, pdf: str | Path | None = None,
              **inputs: Any) -> str:
        """The LaTeX document of what curvgap derived for this module with these inputs
        (every operation of its forward pass, its first derivatives, the loss Hessian's blocks
        and the Hessian-vector products), written in the module's own names: parameters
        (``q_proj.weight`` as :math:`W_q`, ``lam`` as :math:`\\lambda`), sizes (from its
        integer attributes: ``head_dim`` as :math:`d_k`) and intermediates by what they
        compute. ``names`` overrides any symbol: a tensor by the name the document's symbol
        table gives it in the code (``{"q.weight": "W_Q"}``), a size by symbol and value
        (``{"d_k": 3}``). ``pdf``: also compile it there with pdflatex. For a model read as a
        chain of parts, the document of ``part`` (a block's path such as ``"layers.0"``;
        default the first block, or the first part)."""
        from .formulas import module_document, program_of

        module, program, title = program_of(self, X, part, inputs)
        return module_document(module, program, title, names, pdf)

    def layer_slices(self, wrt: Any = None) -> dict[str, slice]:
        """Where each of the module's parameters (``wrt``, default those that require a
        gradient, in the order given) lies in the rows of ``loss_hessian`` and ``gradient``:
        name → slice."""
        slices, offset = {}, 0
        for name in self._wrt(wrt):
            size = self.module.get_parameter(name).numel()
            slices[name] = slice(offset, offset + size)
            offset += size
        return slices
