"""Tracing a module with the inputs of a call: ``torch.export`` with the batch and the
sequence length left free, the graph read into a program (:mod:`.reader`), and at every call
the program's constants made by the module's own code.

A :class:`Trace` serves every call with the same kind of inputs (:func:`signature`): the
same keyword inputs, dtypes and ranks, and the sizes the export fixed (dimensions it could not
leave free).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import re
import sys
import time
import traceback
import unittest.mock
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree

from ..derivations.program import Program
from .nodes import ancestors, differentiable, side_effects
from .own_loss import OwnLoss, is_loss, own_loss, target_of
from .parts import cut
from .reader import program_of
from .records import Constant, Reading, UnsupportedOperation
from .rules import make_table

_DEBUG = bool(os.environ.get("CURVGAP_DEBUG_TRACE"))


@dataclass
class Entry:
    """How a call's values reach the exported graph's placeholders: per placeholder its name,
    its kind (``"user"``, ``"parameter"``, ``"buffer"``, ``"constant"``) and the module's
    name for it; how the call's arguments flatten into the user inputs; the constants the
    export lifted; and ``X``'s sizes (an integer, or an expression in the trace's symbols
    where free)."""

    specs: tuple[tuple[str, str, str | None], ...]
    in_spec_text: str  # pytree's serialised TreeSpec (it pickles with a warning)
    lifted: dict[str, Any]
    X_shape: tuple

    @functools.cached_property
    def in_spec(self) -> pytree.TreeSpec:
        return pytree.treespec_loads(self.in_spec_text)

    def __getstate__(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "in_spec"}

    @classmethod
    def of(cls, exported: torch.export.ExportedProgram, X: str) -> Entry:
        kinds = torch.export.graph_signature.InputKind
        names = {kinds.USER_INPUT: "user", kinds.PARAMETER: "parameter",
                 kinds.BUFFER: "buffer"}
        specs = tuple((s.arg.name, names.get(s.kind, "constant"), s.target)
                      for s in exported.graph_signature.input_specs)
        shape = next(n for n in exported.graph.nodes if n.name == X).meta["val"].shape
        return cls(specs, pytree.treespec_dumps(exported.call_spec.in_spec),
                   dict(exported.constants),
                   tuple(e.node.expr if isinstance(e, torch.SymInt) else int(e) for e in shape))

    def user(self) -> list[str]:
        """The user inputs' placeholders, in order."""
        return [name for name, kind, _ in self.specs if kind == "user"]


@dataclass
class Trace:
    """A module read with one kind of inputs (picklable: cached on disk, :mod:`.readings`):
    how the call reaches the exported graph, the reading of each part (one, or a model's
    blocks and what surrounds them, :mod:`.parts`) with its block path, the graph that makes
    the constants, and per user input the sizes the export fixed (``None`` where free)."""

    entry: Entry
    readings: list[Reading]
    paths: list[str]
    constants: torch.fx.GraphModule | None
    X: str  # the placeholder of the input
    fixed: tuple
    seconds: float
    own: OwnLoss | None = None  # the model's own loss (loss="model")

    @property
    def programs(self) -> list[Program]:
        return [reading.program for reading in self.readings]


@dataclass(frozen=True)
class Call:
    """How the module takes its input ``X``: positionally first, or as the keyword
    ``keyword`` (a Hugging Face model's ``inputs_embeds``), with its batch along
    ``batch_dim``."""

    keyword: str | None = None
    batch_dim: int = 0

    def arguments(self, X: torch.Tensor, kwargs: dict) -> tuple[tuple, dict]:
        """The positional and keyword arguments of the module's call."""
        if self.keyword is None:
            return (X,), dict(kwargs)
        return (), {self.keyword: X, **kwargs}


def _leaves(call: Call, X: torch.Tensor, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    return pytree.tree_flatten(call.arguments(X, kwargs))


def signature(call: Call, X: torch.Tensor, kwargs: dict) -> tuple:
    """What a trace depends on besides the module: how it is called, the structure of the
    inputs, each tensor's dtype, rank and device type (Python values as they are)."""
    leaves, spec = _leaves(call, X, kwargs)
    kinds = tuple((str(v.dtype), v.ndim, v.device.type) if isinstance(v, torch.Tensor)
                  else ("value", repr(v)) for v in leaves)
    return (call, str(spec), kinds)


def _dynamic(call: Call, X: torch.Tensor, kwargs: dict, fixed: frozenset = frozenset()
             ) -> tuple:
    """Dynamic-shape specs: ``X``'s batch and (for rows ``(B, L, d)`` or token ids
    ``(B, L)``) its sequence free;
    the dimensions of other tensors that have those sizes left for the export to relate (but
    those of ``fixed``: ``(id(tensor), dim)``), the rest kept at the size given; a tensor of
    ``X``'s rank (an encoder's states) has its batch there bound to ``X``'s."""
    batch = torch.export.Dim("batch")
    free = {call.batch_dim: batch}
    if X.ndim == 3 or (X.ndim == 2 and not X.is_floating_point()):  # (B, L, d), token ids
        free[1 - call.batch_dim] = torch.export.Dim.DYNAMIC

    free_sizes = {X.shape[k] for k in free}

    def spec(v: torch.Tensor) -> dict:
        # free: a dimension of X's batch or sequence size (a mask's, a rotary table's rows)
        tied = v.ndim == X.ndim and v.shape[call.batch_dim] == X.shape[call.batch_dim]
        return {k: batch if tied and k == call.batch_dim else torch.export.Dim.AUTO
                for k in range(v.ndim) if (tied and k == call.batch_dim) or (
                    v.shape[k] in free_sizes and (id(v), k) not in fixed)}

    args, kw = call.arguments(X, kwargs)
    specs = pytree.tree_map(lambda v: spec(v) if isinstance(v, torch.Tensor) else None, kw)
    if call.keyword is not None:
        specs[call.keyword] = free
    return ((free,) if args else ()) + tuple(specs.values())


def _unbound(exported: torch.export.ExportedProgram, call: Call, X: torch.Tensor,
             kwargs: dict) -> frozenset:
    """The dimensions of the keyword inputs that the export left free but that ``X``'s
    sizes do not determine (``(id(tensor), dim)``): a rotary table's width, an encoder's
    length; the program is read with them at the sizes given. A model's ``labels`` stay free:
    only its own loss's target reads them, made at each call whatever their length."""
    inputs = dict(zip(_user_inputs(exported), _flat(exported.call_spec.in_spec, call, X,
                                                    kwargs)))
    inputs.pop("labels", None)
    shape = next(n for n in exported.graph.nodes if n.op == "placeholder"
                 and inputs.get(n.name) is X).meta["val"].shape
    bound = set().union(*(_symbols(e) for e in shape))
    out = set()
    for node in exported.graph.nodes:
        value = inputs.get(node.name)
        if node.op != "placeholder" or not isinstance(value, torch.Tensor) or value is X:
            continue
        for k, extent in enumerate(node.meta["val"].shape):
            if not _symbols(extent) <= bound:
                out.add((id(value), k))
    return frozenset(out)


def _symbols(extent: object) -> set:
    """The symbols an extent depends on (none for a fixed size)."""
    return set(extent.node.expr.free_symbols) if isinstance(extent, torch.SymInt) else set()


def _user_inputs(exported: torch.export.ExportedProgram) -> list[str]:
    kinds = torch.export.graph_signature.InputKind
    return [s.arg.name for s in exported.graph_signature.input_specs
            if s.kind == kinds.USER_INPUT]


def _flat(in_spec: pytree.TreeSpec, call: Call, X: torch.Tensor, kwargs: dict) -> list:
    """The call's inputs in the order of the exported program's user inputs."""
    return fx_pytree.tree_flatten_spec(call.arguments(X, kwargs), in_spec)


def fixed_sizes(exported: torch.export.ExportedProgram, call: Call, X: torch.Tensor,
                kwargs: dict) -> tuple:
    """Per user input of the export, the sizes it fixed (``None`` where free)."""
    shapes = {n.name: n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder"}
    return tuple(tuple(None if isinstance(e, torch.SymInt) else int(e)
                       for e in shapes[name].shape)
                 if isinstance(shapes[name], torch.Tensor) else None
                 for name in _user_inputs(exported))


def fits(traced: Trace, call: Call, X: torch.Tensor, kwargs: dict) -> bool:
    """Whether this call's inputs have the sizes the trace fixed (where it fixed any)."""
    flat = _flat(traced.entry.in_spec, call, X, kwargs)
    return all(fixed is None or (isinstance(value, torch.Tensor) and value.ndim == len(fixed)
                                 and all(f is None or f == n for f, n in zip(fixed, value.shape)))
               for fixed, value in zip(traced.fixed, flat))


@contextlib.contextmanager
def _quiet_shapes():
    """torch.export logs each data-dependent guard it meets and prints the partial graph of
    a failed export; what curvgap says of the failure is the message the user reads."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _no_kernel_hints():
    """torch's ``TransformerEncoder`` looks at a mask's values to tell whether it is causal,
    only to choose a kernel (the result is the same either way), which no trace can follow:
    traced, the mask is taken as it is."""
    from torch.nn.modules import transformer

    def detect(mask, is_causal=None, size=None):
        return is_causal is True

    with unittest.mock.patch.object(transformer, "_detect_is_causal_mask", detect):
        yield


def export(module: torch.nn.Module, call: Call, X: torch.Tensor,
           kwargs: dict) -> torch.export.ExportedProgram:
    """``torch.export`` of ``module`` on ``X`` and ``kwargs`` with the batch (and sequence)
    free and what they determine; where the module fixes them, at the sizes given."""
    def attempt(dynamic_shapes: tuple | None) -> torch.export.ExportedProgram:
        # fresh aliases of the inputs: a failed export leaves its marks on the tensors
        args, kw = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                                   call.arguments(X, kwargs))
        return torch.export.export(module, args, kw, strict=False,
                                   dynamic_shapes=dynamic_shapes)

    # with gradients on: a torch.no_grad() region of the forward shows in the graph
    with warnings.catch_warnings(), torch.enable_grad(), _no_kernel_hints(), _quiet_shapes():
        warnings.simplefilter("ignore")
        try:
            exported = attempt(_dynamic(call, X, kwargs))
            unbound = _unbound(exported, call, X, kwargs)
            return attempt(_dynamic(call, X, kwargs, unbound)) if unbound else exported
        except Exception as first:  # noqa: BLE001 - the module fixes a size: export as given
            if _DEBUG:
                print(f"curvgap: dynamic export failed: {first}", file=sys.__stderr__)
            try:
                return attempt(None)
            except Exception as error:
                _runs(module, call, X, kwargs)
                data_dependent = _data_dependent(module, error)
                if data_dependent:
                    raise UnsupportedOperation(data_dependent) from None
                first_line = str(error).splitlines()[0] if str(error) else ""
                raise UnsupportedOperation(
                    f"{_failed_in(module, error)}: torch.export could not trace its forward "
                    f"with these inputs ({type(error).__name__}: {first_line}); curvgap reads "
                    "a module's computation from its trace") from None


def _data_dependent(module: torch.nn.Module, error: Exception) -> str | None:
    """Where ``error`` is torch.export's refusal of a shape or branch that depends on tensor
    values (an expert loop over the experts a router chose), what to say: the operation it
    stopped at, what made the size, the line of the module's code, and the submodule whose
    forward runs it (its path); None for any other error."""
    if type(error).__name__ != "GuardOnDataDependentSymNode" and "data-dependent" not in str(
            error).split("\n", 1)[0]:
        return None
    graph = getattr(error, "partial_fx_graph", "") or ""
    operations = re.findall(r"= torch\.ops\.aten\.(\w+)\.", graph)
    symbols = set(re.findall(r"\bu\d+\b", str(getattr(error, "cond", ""))))
    made = next((m.group(2) for m in re.finditer(  # the operation that made the size
        r'^\s*\w+: "[^"]*?\b(u\d+)\b[^"]*" = torch\.ops\.aten\.(\w+)\.', graph, re.M)
        if not symbols or m.group(1) in symbols), None)
    code = re.search(r'The following call raised this error:\n\s*File "([^"]+)", line (\d+), '
                     r'in \w+\n\s*(.+)', str(error))
    where = _failed_in(module, error)
    operation = f"operation {operations[-1]}" if operations else "an operation"
    source = f" of {made}'s result, whose size depends on the values" if made else ""
    line = (f" (`{code.group(3).strip()}` at {os.path.basename(code.group(1))}:"
            f"{code.group(2)})" if code else "")
    return (f"{where}: {operation}{source}{line}: curvgap needs a computation whose shapes "
            "and branches do not depend on tensor values (a data-dependent loop or branch, "
            "as over the experts a router chose, cannot be traced by torch.export; write it "
            "over every expert, e.g. with gather / index_select by the chosen indices)")


def _failed_in(module: torch.nn.Module, error: Exception) -> str:
    """The innermost submodule whose forward was running when ``error`` was raised, as
    ``path (Class)`` (the module's class name where none was)."""
    paths = {id(m): path for path, m in module.named_modules()}
    path = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and id(owner) in paths and paths[id(owner)]:
            path = paths[id(owner)]
    return (f"{path} ({type(module.get_submodule(path)).__name__})" if path
            else type(module).__name__)


def _runs(module: torch.nn.Module, call: Call, X: torch.Tensor, kwargs: dict) -> None:
    """Raise the module's own error, as a :class:`ValueError` about its inputs, where it
    cannot run on them (a trace that fails then says nothing of the module)."""
    args, kw = call.arguments(X, kwargs)
    try:
        with torch.no_grad():
            module(*args, **kw)
    except Exception as error:  # noqa: BLE001 - whatever the module raises, said as it is
        what = call.keyword or "X"
        raise ValueError(f"{what}: {type(module).__name__} does not run on these inputs "
                         f"(shape {tuple(X.shape)}): {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None


def trace(module: torch.nn.Module, call: Call, X: torch.Tensor, kwargs: dict,
          loss: str) -> Trace:
    """Export ``module`` with these inputs, cut its graph into parts and read each (the last
    with ``loss``, the others with the linear loss a chain passes cotangents with). With
    ``loss="model"`` the module's first output is its own loss (:mod:`.own_loss`): the parts
    end at the logits it is the loss of."""
    start = time.perf_counter()
    exported = export(module, call, X, kwargs)
    signature = exported.graph_signature
    graph = exported.graph
    side_effects(graph)
    kinds = torch.export.graph_signature.OutputKind
    mutated = [str(s.target) for s in signature.output_specs if s.kind != kinds.USER_OUTPUT]
    if mutated:
        raise UnsupportedOperation(f"{type(module).__name__}: it changes {', '.join(mutated)} "
                                   "when it runs (statistics in training mode?); call "
                                   "module.eval()")
    output_node = next(n for n in graph.nodes if n.op == "output")
    user = [arg for arg, spec in zip(output_node.args[0], signature.output_specs)
            if spec.kind == kinds.USER_OUTPUT]
    main = next((a for a in user if isinstance(a, torch.fx.Node)
                 and isinstance(a.meta.get("val"), torch.Tensor)), None)
    own = None
    if loss == "model" and main is not None:
        main, own = own_loss(main, type(module).__name__)
        loss = own.kind
    elif main is not None and is_loss(main):
        raise UnsupportedOperation(f"{type(module).__name__}: its first output is its own loss "
                                   f"(it was given labels=...); pass loss='model' to take "
                                   f"that loss, or call it without labels= for loss={loss!r} "
                                   f"of its logits")
    # a parameter that requires no gradient is a constant, as autograd has it
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    params = {node: name for node, name in signature.inputs_to_parameters.items()
              if name not in frozen}
    X_name = (signature.user_inputs[0] if call.keyword is None else
              next(n for n in signature.user_inputs if n == call.keyword))
    live = differentiable(graph, {X_name, *params})
    if main is None or main.name not in live:
        raise UnsupportedOperation(f"{type(module).__name__}: expected its first output to be "
                                   "a tensor that depends on X or on the parameters")
    live &= ancestors(main)
    sources = cut(graph, live, X_name, params, main, call.batch_dim)
    readings = []
    for k, source in enumerate(sources):
        title = _title(module, source.root)
        last = k == len(sources) - 1
        readings.append(program_of(source, title, loss if last else "linear"))
    fixed = fixed_sizes(exported, call, X, kwargs)
    constants = [c for reading in readings for c in reading.constants]
    made = _constant_graph(exported, _made(constants, own))
    return Trace(Entry.of(exported, X_name), readings, [s.root for s in sources], made,
                 X_name, fixed,
                 time.perf_counter() - start, own)


def _title(module: torch.nn.Module, path: str) -> str:
    """The class name of the submodule at ``path`` (of the module itself for ``""``)."""
    try:
        return type(module.get_submodule(path)).__name__ if path else type(module).__name__
    except AttributeError:
        return type(module).__name__


def _made(constants: list[Constant], own: OwnLoss | None) -> list[str]:
    """The graph nodes made at each call: those of the ``constants``, and the target of the
    model's ``own`` loss."""
    names = [name for c in constants if c.kind == "node" for name in _nodes(c)]
    return list(dict.fromkeys(names + ([own.target] if own is not None else [])))


def _constant_graph(exported: torch.export.ExportedProgram,
                    wanted: list[str]) -> torch.fx.GraphModule | None:
    """The part of the exported graph that makes the nodes ``wanted`` (the constants the
    program reads), as a graph module taking every placeholder and returning them in
    order."""
    if not wanted:
        return None
    graph = exported.graph
    nodes = {n.name: n for n in graph.nodes}
    needed: set[str] = set()
    pending = [nodes[name] for name in wanted]
    while pending:
        node = pending.pop()
        if node.name not in needed:
            needed.add(node.name)
            pending.extend(node.all_input_nodes)
    out = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node.name in needed:
            env[node] = out.node_copy(node, lambda n: env[n])
    out.output(tuple(env[nodes[name]] for name in wanted))
    return torch.fx.GraphModule(exported.graph_module, out)


def _nodes(constant: Constant) -> tuple[str, ...]:
    """The graph nodes a constant is made from."""
    return constant.node if isinstance(constant.node, tuple) else (constant.node,)


def placeholders(inputs: Entry, module: torch.nn.Module, call: Call, X: torch.Tensor,
                 kwargs: dict) -> list:
    """The values of every placeholder of the exported graph for this call: parameters and
    buffers read from the module now, lifted constants, and the call's inputs."""
    user = dict(zip(inputs.user(), _flat(inputs.in_spec, call, X, kwargs)))
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    values = []
    for name, kind, target in inputs.specs:
        if kind == "user":
            values.append(user[name])
        elif target in params:
            values.append(params[target].detach())
        elif target in buffers:
            values.append(buffers[target])
        else:
            values.append(_attribute(module, target, inputs.lifted[target]))
    return values


def _attribute(module: torch.nn.Module, target: str, traced: Any) -> Any:
    """The module's tensor attribute at the dotted path ``target`` as it is now (one set
    or changed in place after the trace), else the constant the trace lifted (a tensor the
    forward makes)."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor) and \
            value.shape == traced.shape and value.dtype == traced.dtype:
        return value
    return traced


def doubled(value: Any, dim: int) -> Any:
    """``value`` with each tensor of one sample along ``dim`` repeated to two (in tuples,
    lists and dicts too)."""
    if isinstance(value, torch.Tensor):
        return (torch.cat([value, value], dim) if value.ndim > dim and value.shape[dim] == 1
                else value)
    if isinstance(value, tuple | list):
        return type(value)(doubled(v, dim) for v in value)
    if isinstance(value, dict):
        return {k: doubled(v, dim) for k, v in value.items()}
    return value


def constants(trace: Trace, module: torch.nn.Module, call: Call, X: torch.Tensor,
              kwargs: dict, dims: list[dict[str, int]]
              ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """Each part's constants for this call (``dims``: each part's sizes), laid out as the
    generated code takes them (the batch first), in ``X``'s dtype (the parameters' for token
    ids) and on its device; and the target of the model's own loss (``None`` without one),
    along the logits' rows as the module lays them out."""
    computed: dict[str, torch.Tensor] = {}
    one = X.ndim > call.batch_dim and X.shape[call.batch_dim] == 1
    run = (doubled(X, call.batch_dim), doubled(kwargs, call.batch_dim)) if one else (
        X, kwargs)
    if trace.constants is not None:
        # a batch of one was read on the sample twice (the trace may hold that batch size):
        # computed on it twice, sample 0 kept
        with torch.no_grad():
            values = trace.constants(*placeholders(trace.entry, module, call, *run))
        constants = [c for reading in trace.readings for c in reading.constants]
        computed = dict(zip(_made(constants, trace.own), values))
    target = None
    if trace.own is not None:
        sizes = {extent: size for extent, size in zip(trace.entry.X_shape,
                                                      run[0].shape)
                 if not isinstance(extent, int)}
        target = target_of(trace.own, computed[trace.own.target], sizes)
        if one:
            target = target.narrow(trace.readings[-1].batch_dim, 0, 1)
    like = X if X.is_floating_point() else next(module.parameters())
    out = []
    for reading, part_dims in zip(trace.readings, dims):
        values = {}
        for constant in reading.constants:
            if constant.kind == "node":
                value = _transformed([computed[n] for n in _nodes(constant)],
                                     constant.transform, like)
                if constant.batch_dim is not None:
                    value = value.movedim(constant.batch_dim, 0)
                    value = value[:1] if one else value
            else:
                value = _table(constant, part_dims, like)
            values[constant.name] = value.contiguous()
        out.append(values)
    return out, target


def _transformed(values: list[torch.Tensor], transform: str,
                 X: torch.Tensor) -> torch.Tensor:
    """A constant as the program reads it, made from its nodes' ``values``: a float tensor
    like ``X`` (the transforms are :class:`~.reader.Constant`'s)."""
    kind, _, arg = transform.partition(":")
    options = dict(dtype=X.dtype, device=X.device)
    if kind in ("then", "else"):  # (mask, value): the value where the mask is (not) true
        mask, value = values
        zero = torch.zeros((), **options)
        value = value.to(X.dtype)
        return torch.where(mask.bool(), value, zero) if kind == "then" else torch.where(
            mask.bool(), zero, value)
    if kind == "padding":  # (indices, table): the table's row p where an index is p
        ids, table = values
        row = table[int(arg)].to(X.dtype)
        return torch.where((ids == int(arg)).unsqueeze(-1), row, torch.zeros((), **options))
    (value,) = values
    if kind in ("one_hot", "index"):  # an index counts from the end if < 0
        classes, _, padding = arg.partition(":")
        low = -int(classes) if kind == "index" else 0
        if value.numel() and (int(value.min()) < low or int(value.max()) >= int(classes)):
            # indices the module makes from X's shape (its positions) past the table's rows
            length = value.shape[-1] if value.ndim else 1
            raise ValueError(
                f"X: a sequence of {length} positions, but the module's position table has "
                f"{classes} rows" if low == 0 and int(value.min()) >= 0 and
                int(value.max()) == length - 1 else
                f"X: the module reads rows {int(value.min())} to {int(value.max())} of a "
                f"table of {classes} rows (expected indices in [{low}, {classes}))")
        value = value.long() % int(classes) if kind == "index" else value.long()
        hot = torch.nn.functional.one_hot(value, int(classes)).to(X.dtype)
        return hot * (value != int(padding)).unsqueeze(-1).to(X.dtype) if padding else hot
    if kind in ("fill", "fill_not"):  # a number where a mask is true (false), 0 elsewhere
        where = value.bool() if kind == "fill" else ~value.bool()
        return torch.zeros(value.shape, **options).masked_fill(where, float(arg))
    if kind == "not":  # 1 where a boolean mask is false
        return (~value.bool()).to(X.dtype)
    if kind == "additive_keep":  # a boolean mask, True where attention is kept; a row
        kept = value.bool()                  # that keeps nothing is 0 (it attends to nothing)
        rows = kept.any(-1, keepdim=True)
        return torch.zeros(value.shape, **options).masked_fill(~kept & rows, float("-inf"))
    if kind == "rows_kept":  # 1 where a row of a boolean mask keeps some entry
        return value.bool().any(-1, keepdim=True).to(X.dtype)
    if kind in ("additive_safe", "rows_finite"):  # an additive mask, and its rows
        finite = (value.to(X.dtype) > float("-inf")).any(-1, keepdim=True)
        if kind == "rows_finite":
            return finite.to(X.dtype)
        return torch.where(finite, value.to(X.dtype), X.new_zeros(()))
    return value.to(X.dtype)  # a boolean or integer one promoted, as torch's arithmetic does


def _table(constant: Constant, dims: dict[str, int], X: torch.Tensor) -> torch.Tensor:
    """A table of the program's own (a selection, a placement, a causal mask), made by the
    maker its rule registered."""
    details, extents = constant.details
    kind, args = (details[0], details[1:]) if constant.kind == "select" else (constant.kind,
                                                                                details[1:])
    sizes = [math.prod(dims[name] for name in dim) for dim in extents]
    return make_table(kind, args, sizes, X)
