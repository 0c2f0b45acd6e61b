"""Reading a traced module: its ATen operations lowered into a
:class:`~curvgap.derivations.program.Program`, one ``_read_<operation>`` method per operation.

The graph comes from ``torch.export`` (:mod:`.trace`). Every node that depends on the input
``X`` or on a parameter is *differentiable* and becomes program operations: linear maps,
products, sums, reductions and reshapes become einsums over split axes (:mod:`.axes`),
elementwise chains are fused into one SymPy function of one tensor (an activation, a shifted
reciprocal square root), ``softmax`` is the engine's primitive, and ``layer_norm`` and
``scaled_dot_product_attention`` are written out in those terms. Every other node (masks,
position ids, rotary tables, shapes) is a *constant*: computed by the module's own code at
call time (:mod:`.trace`), passed to the generated code as an input. Anything else is refused
with the operation, the submodule's path and what is missing.

The reading runs twice (or until nothing changes): a reshape met late may split an axis met
early, and the second pass reads every tensor with its final factors.
"""

from __future__ import annotations

import fractions
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy as sp
import torch

from ..derivations.functions import sigmoid, softplus, x
from ..derivations.program import Input, Op, Operand, Program, Term
from .axes import Axis, Changes, ShapeError, Size, align, extent_of, regroup

aten = torch.ops.aten


class UnsupportedLayer(ValueError):
    """The module does something curvgap does not represent; nothing is approximated."""


class UnsupportedOperation(UnsupportedLayer):
    """A traced operation curvgap does not represent, named with its submodule's path."""


#: the ``constant`` of ``X`` given as integer token ids (and of its views): read only as an
#: embedding's indices, where the program's ``X`` becomes their one-hot rows (the embedding is
#: then the linear map ``X W``, its derivatives in ``X`` those in the one-hot rows)
TOKENS = "X: token ids"

#: what an empty slice reads as (a tensor of no entries; only concatenated, where it drops)
EMPTY = object()


@dataclass
class Value:
    """A traced tensor as the program holds it: its dimensions (each a list of axes, ``[]``
    for a dimension of size one), and the program tensor ``tensor`` (axes ``axes``) of which it
    is the elementwise function ``expr`` (of :data:`x`). Axes of ``dims`` that ``tensor`` lacks
    are broadcast. A constant (``constant`` set: computed at call time) has no tensor until a
    differentiable operation reads it."""

    dims: list[list[Axis]]
    tensor: str | None = None
    axes: list[Axis] = field(default_factory=list)
    expr: sp.Expr = x
    #: the name of the graph node that computes it (the names of those it is made from)
    constant: str | tuple[str, ...] | None = None
    transform: str = "same"  # how a constant's value is made a float tensor
    #: the node, operation and submodule that made ``expr``
    origin: tuple[str, str, str] = ("", "", "")


@dataclass
class Constant:
    """A program constant and how to make it at call time: the value of the graph node
    ``node``, or one made from the values of the nodes ``node`` names (``kind = "node"``),
    or a table of the program's own (``select``: a slice or an
    index as a 0/1 matrix, ``place``: where a concatenation puts a piece, ``causal``: 0 / -inf
    above the diagonal; ``details`` say which, with the sizes of its dimensions); the
    ``transform`` that makes a node's value a float tensor (``same``; ``float``: a mask as 0/1;
    ``not``: 1 where a mask is false; ``fill:c``: ``c`` where a mask is true, 0 elsewhere;
    ``additive_keep``: a boolean attention mask as 0 / -inf, a row that keeps nothing as 0;
    ``rows_kept``: 1 for the rows of such a mask that keep something; ``additive_safe`` and
    ``rows_finite``: the same for an additive mask; ``one_hot:N`` (``one_hot:N:p``):
    indices as one-hot rows over ``N`` (a row of zeros for the index ``p``); of the nodes
    ``(mask, value)``: ``then``, the value where the mask is true, 0 elsewhere, and ``else``
    the other way; of ``(indices, table)``: ``padding:p``, the table's row ``p`` where an
    index is ``p``, 0 elsewhere); and the dimension of the value that holds the batch
    (``None``: shared by every sample)."""

    name: str
    kind: str
    node: str | tuple[str, ...] = ""
    transform: str = "same"
    batch_dim: int | None = None
    details: tuple = ()


@dataclass
class Reading:
    """What a reading gives: the program, its constants' recipes, and which parameter of the
    module each program parameter is (by the module's name)."""

    program: Program
    constants: list[Constant]
    params: dict[str, str]  # program name -> module parameter name
    #: the sizes bound at call time, by name: the symbols of the trace they stand for
    symbols: dict[str, sp.Expr] = field(default_factory=dict)
    #: where the output holds the batch (the program's output has it first)
    batch_dim: int = 0
    #: token ids as ``X``: the program's ``X`` is their one-hot rows over this vocabulary
    vocabulary: int | None = None
    #: the embedding's padding index among those ids: its one-hot rows are zeros (torch's
    #: backward leaves the table's row alone), the row itself a constant of the program
    padding: int | None = None
    #: where the module computes in a narrower float than its input (``"float32 (cast from
    #: float64 before softmax)"``; empty where it does not): the program computes in the wider one,
    #: so where the module's narrower numbers overflow, the two differ
    narrowing: str = ""


def _identifier(name: str) -> str:
    """``name`` as a Python identifier (dots and other characters as underscores)."""
    out = re.sub(r"\W", "_", name)
    return out if not out[:1].isdigit() else f"_{out}"


def _number(value: float | int | bool) -> sp.Expr:
    """A Python number from a trace as SymPy holds it: an integer as itself; a float as the
    simple number it visibly is when that number rounds to it (a short fraction ``1/2``,
    ``1/3``, the square root of one: ``1/sqrt(3)`` to the last bit of its float), else the
    float it is (``0.044715``, ``1e-12``, ``finfo.min``). Never an exact rational of a
    float's binary value (a 300-digit integer for ``finfo.max``)."""
    if isinstance(value, bool | int):
        return sp.Integer(int(value))
    if not math.isfinite(value):
        raise ValueError("not finite")
    if value == int(value) and abs(value) < 2 ** 53:
        return sp.Integer(int(value))
    short = fractions.Fraction(value).limit_denominator(1000)
    if float(short) == value and abs(short.numerator) < 10 ** 6:
        return sp.Rational(short.numerator, short.denominator)
    if 1e-6 < abs(value) < 1e6:
        square = fractions.Fraction(value * value).limit_denominator(1000)
        root = sp.sqrt(sp.Rational(square.numerator, square.denominator))
        root = root if value > 0 else -root
        if abs(float(root) - value) <= math.ulp(value):  # 1/sqrt(3) is rounded twice
            return root
    return sp.Float(value, precision=53)  # printed as a float's shortest repr


def _path(node: torch.fx.Node) -> str:
    """The submodule a node comes from, as a dotted path (``layers.3.mlp.act_fn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return "" if path.startswith("_empty") else path


def _stops(node: torch.fx.Node) -> bool:
    """Whether autograd passes no derivative through ``node``: a ``detach`` (a
    straight-through estimator's ``x + (f(x) - x).detach()``), a ``torch.no_grad()``
    region."""
    return node.target in _CONSTANT_OUTPUT or (
        node.target is torch.ops.higher_order.wrap_with_set_grad_enabled
        and node.args[0] is False)


def refusal(node: torch.fx.Node | None, missing: str, root: str = "") -> UnsupportedOperation:
    """The error for ``node``: its operation, its submodule (else ``root``), what is
    missing."""
    where = (_path(node) if node is not None else "") or root
    if node is None:
        return UnsupportedOperation(f"{where or 'the module'}: curvgap needs {missing}")
    target = node.target
    name = (getattr(target, "__name__", None) or str(target)).removesuffix(".default")
    name = re.sub(r"^aten\.", "", str(getattr(target, "_overloadpacket", name)))
    return UnsupportedOperation(f"{where or 'the module'}: operation {name} "
                                f"(node {node.name}): curvgap needs {missing}")


def side_effects(graph: torch.fx.Graph) -> None:
    """Refuse an operation that changes a tensor in place and whose result nothing reads
    (``nn.Embedding(max_norm=...)`` rescales rows of its table at every call): the module's
    weights would then differ from call to call."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and not node.users:
            what = ("an embedding without max_norm (it rescales rows of its table in place at "
                    "every call)" if node.target is aten.embedding_renorm_.default else
                    "no operation that changes a tensor in place for its side effect")
            raise refusal(node, what)


#: operations whose result autograd does not differentiate: ``detach`` stops derivatives
#: (``x + (f(x) - x).detach()``), the others read only their input's shape
_CONSTANT_OUTPUT = {aten.detach.default, aten.zeros_like.default, aten.ones_like.default,
                    aten.full_like.default, aten.empty_like.default, aten.new_zeros.default,
                    aten.new_ones.default, aten.new_full.default, aten.new_empty.default}


def ancestors(node: torch.fx.Node) -> set[str]:
    """The names of ``node`` and of every node it is computed from."""
    seen: set[str] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current.name not in seen:
            seen.add(current.name)
            pending.extend(current.all_input_nodes)
    return seen


def differentiable(graph: torch.fx.Graph, sources: set[str]) -> set[str]:
    """The nodes of ``graph`` that depend on the placeholders ``sources`` (``X``, the
    parameters) through operations autograd differentiates and hold floating-point values:
    what carries a derivative. Every other node is a constant, made at call time."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in sources:
                out.add(node.name)
        elif node.op == "call_function" and not _stops(node) and any(
                arg.name in out for arg in node.all_input_nodes) and (
                _floating(node.meta.get("val")) or node.target in _VIEWS):
            out.add(node.name)  # a view of integer token ids too: an embedding reads it
    return out


def _floating(value: object) -> bool:
    """Whether a node's value is a floating-point tensor (or a tuple of them): what can carry
    a derivative."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, tuple | list):
        return any(_floating(v) for v in value)
    return False



def _symbol(size: Size) -> sp.Symbol:
    """A stand-in for the size symbol of ``size``'s class (named when the reading ends)."""
    return sp.Symbol(f"_size{size.root().order}", positive=True, integer=True)


def _canonical_names(names: list[str], taken: set[str]) -> dict[str, str]:
    """Each of ``names`` (in order) without the graph's numbering (``linear_7`` → ``linear``),
    numbered again in order of appearance (``taken`` names excluded): equal operations of
    equal blocks get equal names."""
    out, taken = {}, set(taken)
    for name in names:
        stem = re.sub(r"_\d+(?=_|$)", "", name) or name
        new, k = stem, 1
        while new in taken:
            k += 1
            new = f"{stem}_{k}"
        taken.add(new)
        out[name] = new
    return out


def _extent(value: object) -> int | sp.Expr:
    """A dimension's extent: an int, or the SymPy expression of a symbolic size."""
    if isinstance(value, torch.SymInt):
        return extent_of(value.node.expr)
    return int(value)


#: The readers of single operations, by ATen overload (filled by :func:`reads`).
READERS: dict[object, Callable] = {}

#: operations that read a tensor another way (what token ids may go through to an embedding)
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unflatten.int, aten.flatten.using_ints, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
          aten.contiguous.default, aten.clone.default, aten.alias.default, aten.to.device,
          aten._to_copy.default}


def reads(*targets: object) -> Callable:
    """Register the decorated method as the reader of ``targets``."""
    def register(method: Callable) -> Callable:
        for target in targets:
            READERS[target] = method
        return method
    return register


@dataclass
class Source:
    """A graph to read: its placeholders that are parameters (name → the parameter's name in
    the module, relative to ``root``), the placeholder of ``X``, and the node of the main
    output; every other placeholder is a constant."""

    graph: torch.fx.Graph
    params: dict[str, str]
    X: str
    output: torch.fx.Node
    root: str = ""
    batch_dim: int = 0  # where X holds its batch


class Reader:
    """Lowers one graph into a :class:`Program` (see the module docstring)."""

    def __init__(self, source: Source, title: str, loss: str) -> None:
        self.source = source
        self.graph = source.graph
        self.title, self.loss, self.root = title, loss, source.root
        self.param_of = dict(source.params)
        self._sizes: dict[tuple, Size] = {}
        self.batch: Size | None = None
        self.hints: dict[Size, str] = {}

    # -- passes ------------------------------------------------------------------------------
    def read(self) -> Reading:
        """The program of the graph (see the module docstring)."""
        for _ in range(5):
            before = Changes.count
            reading = self._pass()
            if Changes.count == before:
                return reading
        raise UnsupportedOperation("the module: its reshapes did not settle into common "
                                   "factors")

    def _pass(self) -> Reading:
        self.values: dict[str, object] = {}
        self.ops: list[dict] = []
        self.inputs: dict[str, tuple[str, Value]] = {}
        self._tensor_axes: dict[str, list[Axis]] = {}
        self.constants: dict[str, Constant] = {}
        self.declared: dict[tuple, Value] = {}
        self.mapped: dict[tuple, tuple] = {}
        self.names: set[str] = {"X"}
        self.params: dict[str, str] = {}
        self.labels = 0
        self.guards: list[tuple[str, str, str]] = []
        self.node: torch.fx.Node | None = None
        self.vocabulary: int | None = None
        self.padding: int | None = None
        self.narrowing = ""
        # what the output is computed from (a second output's pooler is not)
        self.differentiable = differentiable(self.graph, {self.source.X, *self.param_of}) & \
            ancestors(self.source.output)
        output = None
        for node in self.graph.nodes:
            self.node = node
            try:
                if node.op == "placeholder":
                    self.values[node.name] = self._placeholder(node)
                elif node.op == "output":
                    output = self._output(node)
                elif node.name not in self.differentiable:
                    self.values[node.name] = self._constant(node)
                else:
                    self.values[node.name] = self._operation(node)
            except ShapeError as error:
                raise self.refuse(f"shapes it can split into common factors ({error})") \
                    from None
        self.node = None
        return self._finish(output)

    # -- sizes, axes, values -----------------------------------------------------------------
    def size(self, key: tuple, extent: int | sp.Expr) -> Size:
        """The size class of ``key`` (the same object in every pass); every dimension of one
        symbolic extent shares one class."""
        extent = extent_of(extent)
        if not isinstance(extent, int):
            key = ("symbol", extent)
        if key not in self._sizes:
            self._sizes[key] = Size(extent)
        return self._sizes[key]

    def fresh(self, shape: tuple, key: str) -> list[list[Axis]]:
        """Axes for a tensor of ``shape`` met first at ``key`` (a dimension of one has none)."""
        dims = []
        for k, extent in enumerate(shape):
            extent = _extent(extent)
            dims.append([] if extent == 1 else [Axis(self.size((key, k), extent))])
        return dims

    def is_batch(self, axis: Axis) -> bool:
        return self.batch is not None and axis.size.root() is self.batch.root()

    @staticmethod
    def leaf_dims(value: Value) -> list[list[Axis]]:
        return [[leaf for axis in dim for leaf in axis.leaves()] for dim in value.dims]

    def axes_of(self, tensor: str) -> list[Axis]:
        """The axes of the program tensor ``tensor`` (the batch left out), as leaves."""
        return [leaf for axis in self._tensor_axes[tensor] for leaf in axis.leaves()
                if not self.is_batch(leaf)]

    def leaf_axes(self, value: Value) -> list[Axis]:
        """The axes of ``value``'s program tensor (the batch left out), as leaves."""
        return [leaf for axis in value.axes for leaf in axis.leaves() if not self.is_batch(leaf)]

    def label(self) -> str:
        self.labels += 1
        return f"i{self.labels}"

    def value(self, arg: object) -> Value:
        """The value of a graph argument (a node)."""
        if isinstance(arg, torch.fx.Node):
            value = self.values[arg.name]
            if isinstance(value, Value):
                return value
            if value is EMPTY:
                raise self.refuse("a tensor with entries (an empty slice is only concatenated)")
        raise self.refuse(f"a tensor argument, got {arg!r}")

    def name(self, hint: str) -> str:
        """A fresh program tensor name from ``hint``."""
        base = _identifier(hint)
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def shape_of(self, node: torch.fx.Node) -> list[int | sp.Expr]:
        meta = node.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            raise self.refuse(f"a tensor result, got {meta!r}")
        return [_extent(e) for e in meta.shape]

    # -- errors --------------------------------------------------------------------------------
    def refuse(self, missing: str) -> UnsupportedOperation:
        """The error for the current node: its operation, its submodule, what is missing."""
        return refusal(self.node, missing, self.root)

    # -- placeholders, constants, output ---------------------------------------------------------
    def _placeholder(self, node: torch.fx.Node) -> object:
        meta = node.meta.get("val")
        if node.name in self.param_of:
            source = self.param_of[node.name]
            name = self.name(source)
            dims = self.fresh(tuple(meta.shape), node.name)
            value = Value(dims, name, [a for dim in dims for a in dim])
            self.inputs[name] = ("param", value)
            self._tensor_axes[name] = value.axes
            self.params[name] = source
            return value
        if node.name == self.source.X:
            if not isinstance(meta, torch.Tensor) or meta.is_complex() or meta.dtype == torch.bool:
                raise UnsupportedOperation(f"X: expected a floating-point tensor or integer "
                                           f"token ids as the module's first input, got "
                                           f"{meta!r}")
            dims = self.fresh(tuple(meta.shape), node.name)
            at = self.source.batch_dim
            if len(dims) < 2 or not dims[at]:
                raise UnsupportedOperation(f"X: expected a batch of at least two samples "
                                           f"along dimension {at} to read the module with, "
                                           f"got shape {tuple(meta.shape)}")
            self.batch = dims[at][0].size
            if not meta.is_floating_point():
                return Value(dims, constant=TOKENS)
            value = Value(dims, "X", [a for dim in dims for a in dim])
            self.inputs["X"] = ("input", value)
            self._tensor_axes["X"] = value.axes
            return value
        return self._constant(node)

    def _constant(self, node: torch.fx.Node) -> object:
        meta = node.meta.get("val")
        if isinstance(meta, torch.Tensor):
            return Value(self.fresh(tuple(meta.shape), node.name), constant=node.name)
        return meta

    def _output(self, node: torch.fx.Node) -> Value:
        main = self.source.output
        if main.name not in self.differentiable:
            raise UnsupportedOperation(f"{self.root or 'the module'}: expected its first "
                                       "output to be a tensor that depends on X or on the "
                                       "parameters")
        return self.value(main)

    def declare(self, value: Value) -> Value:
        """A constant ``value`` as a program input (its own dimension order; the batch, if it
        has one, passed first)."""
        if value.constant == TOKENS:
            raise self.refuse("token ids read only as an embedding's indices (give "
                              "inputs_embeds= to a module that computes with them otherwise)")
        key = (value.constant, value.transform)
        if key not in self.declared:
            leaves = self.leaf_dims(value)
            batch = [k for k, dim in enumerate(leaves) if any(self.is_batch(a) for a in dim)]
            if len(batch) > 1 or (batch and len(leaves[batch[0]]) > 1):
                raise self.refuse("a constant whose batch is a dimension of its own")
            made_of = value.constant if isinstance(value.constant, tuple) else (value.constant,)
            name = self.name("c_" + "_".join(made_of))
            declared = Value(value.dims, name, [a for dim in value.dims for a in dim])
            self.inputs[name] = ("constant", declared)
            self._tensor_axes[name] = declared.axes
            self.constants[name] = Constant(name, "node", value.constant, value.transform,
                                            batch[0] if batch else None)
            self.declared[key] = declared
        declared = self.declared[key]
        return Value(value.dims, declared.tensor, declared.axes)

    def table(self, kind: str, dims: list[list[Axis]], details: tuple) -> Value:
        """A constant table of the program's own (a selection, a causal mask), made at call
        time from ``details`` and the extents of ``dims``."""
        if any(self.is_batch(a) for dim in dims for a in dim):
            raise self.refuse("a selection along a dimension that holds no batch (a reshape "
                              "merged the batch into it: samples would mix)")
        key = (kind, details, tuple(tuple(a.size.root().order for a in dim) for dim in dims))
        if key not in self.declared:
            name = self.name(f"c_{kind}")
            value = Value(dims, name, [a for dim in dims for a in dim])
            self.inputs[name] = ("constant", value)
            self._tensor_axes[name] = value.axes
            extents = tuple(tuple(a.size.root() for a in dim) for dim in dims)
            self.constants[name] = Constant(name, kind, details=(details, extents))
            self.declared[key] = value
        return self.declared[key]  # its own axes (a table met again reads them)

    # -- emitting --------------------------------------------------------------------------------
    def held(self, value: Value) -> Value:
        """``value`` with a program tensor holding it: a constant declared, an elementwise
        function computed (a ``map``)."""
        if value.tensor is None:  # a constant: declared, then its function (1/c) mapped
            declared = self.declare(Value(value.dims, constant=value.constant,
                                          transform=value.transform))
            value = Value(declared.dims, declared.tensor, declared.axes, value.expr,
                          origin=value.origin)
        if value.expr == x:
            return value
        key = (value.tensor, sp.srepr(value.expr))
        if key not in self.mapped:
            source = self.axes_of(value.tensor)
            labels = [self.label() for _ in source]
            node, what, path = value.origin
            name = self.name(node or (self.node.name if self.node is not None else "f"))
            axes = [Axis(a.size.root()) for a in source]
            self.ops.append(dict(kind="map", out=name, labels=labels,
                                 axes=list(zip(labels, [a.size.root() for a in source])),
                                 fn=value.expr, source=(value.tensor, labels),
                                 what=what or self.what(), path=path or self.where()))
            self._tensor_axes[name] = axes
            self.mapped[key] = (name, source, axes)
        name, source, axes = self.mapped[key]
        mapping = {id(s): a for s, a in zip(source, axes)}
        dims = [[mapping.get(id(leaf), leaf) for leaf in dim] for dim in self.leaf_dims(value)]
        batch = [leaf for axis in value.axes for leaf in axis.leaves() if self.is_batch(leaf)]
        return Value(dims, name, batch + axes)

    def where(self) -> str:
        """The submodule the current operation comes from, relative to the part read (a
        dotted path: equal for the same operation in every block)."""
        path = _path(self.node) if self.node is not None else ""
        if self.root and (path == self.root or path.startswith(self.root + ".")):
            path = path[len(self.root):].lstrip(".")
        return path

    def what(self) -> str:
        """A short name of the current operation (for documents and generated names)."""
        target = self.node.target if self.node is not None else ""
        name = str(getattr(target, "_overloadpacket", getattr(target, "__name__", target)))
        return _identifier(name.removeprefix("aten."))

    def operand(self, value: Value, dim_labels: list[list[str | None]]) -> tuple:
        """``(tensor, labels)``: ``value``'s program tensor read with one label per leaf of each
        of its dimensions (``None`` for the batch)."""
        value = self.held(value)
        by_axis: dict[int, str | None] = {}
        for dim, labels in zip(self.leaf_dims(value), dim_labels):
            if len(dim) != len(labels):
                raise ShapeError("a dimension read with the wrong number of factors")
            for axis, label in zip(dim, labels):
                by_axis[id(axis)] = label
        labels = []
        for axis in self.leaf_axes(value):
            label = by_axis.get(id(axis))
            if label is None:
                raise self.refuse("every axis of a tensor read (an axis summed over the batch, "
                                  "or one that a reshape mixed with the batch)")
            labels.append(label)
        return (value.tensor, labels)

    def emit(self, out_dims: list[list[Size]], labels: list[list[str | None]],
             terms: list[tuple[sp.Expr, list[tuple]]], hint: str = "") -> Value:
        """A new tensor ``Σ coeff Π operands`` with dimensions of the classes ``out_dims``,
        written at ``labels`` (``None`` for the batch, which no tensor stores)."""
        name = self.name(hint or self.node.name)
        dims = [[Axis(size.root()) for size in dim] for dim in out_dims]
        out_labels, axes_of = [], {}
        for dim, dim_labels in zip(dims, labels):
            for axis, label in zip(dim, dim_labels):
                if label is not None:
                    out_labels.append(label)
                    axes_of[label] = axis.size.root()
        for _, operands in terms:
            for tensor, operand_labels in operands:
                for label, axis in zip(operand_labels, self.axes_of(tensor)):
                    if label in axes_of:  # one label, one size: align what meets there
                        align([axes_of[label]], [axis.size])
                    axes_of.setdefault(label, axis.size.root())
        self.ops.append(dict(kind="einsum", out=name, labels=out_labels,
                             axes=list(axes_of.items()), terms=terms, what=self.what(),
                             path=self.where()))
        value = Value(dims, name, [a for dim in dims for a in dim])
        self._tensor_axes[name] = value.axes
        return value

    def out_labels(self, sizes: list[list[Size]]) -> list[list[str | None]]:
        """Fresh labels for dimensions of the classes ``sizes`` (``None`` for the batch)."""
        return [[None if size.root() is self.batch.root() else self.label() for size in dim]
                for dim in sizes]

    def broadcast(self, values: list[Value]) -> tuple[list[list[Size]], list[list]]:
        """Align ``values`` as torch broadcasts them (dimensions from the right): the
        output's dimensions (classes) and its labels, and each value's labels."""
        rank = max(len(v.dims) for v in values)
        offsets = [rank - len(v.dims) for v in values]
        for position in range(rank):
            dims = [self.leaf_dims(v)[position - o] for v, o in zip(values, offsets)
                    if position >= o]
            full = [d for d in dims if d]
            for other in full[1:]:
                align([a.size for a in full[0]], [a.size for a in other])
        out_sizes, out_labels = [], []
        per_value: list[list] = [[] for _ in values]
        for position in range(rank):
            dims = {n: self.leaf_dims(v)[position - o]
                    for n, (v, o) in enumerate(zip(values, offsets)) if position >= o}
            full = next((d for d in dims.values() if d), [])
            sizes = [a.size.root() for a in full]
            labels = self.out_labels([sizes])[0]
            out_sizes.append(sizes)
            out_labels.append(labels)
            for n, dim in dims.items():
                per_value[n].append(labels if dim else [])
        return out_sizes, [out_labels, *per_value]

    def combine(self, values: list[Value], terms: list[tuple[sp.Expr, list[int]]],
                hint: str = "") -> Value:
        """``Σ coeff Π values[k]`` elementwise, broadcast as torch does."""
        sizes, (labels, *per_value) = self.broadcast(values)
        return self.emit(sizes, labels, [
            (coeff, [self.operand(values[k], per_value[k]) for k in members])
            for coeff, members in terms], hint)

    def scaled(self, value: Value) -> tuple[sp.Expr, Value]:
        """``(c, v)`` with ``value = c · v``: a scale of a tensor stays a coefficient."""
        coeff = sp.simplify(value.expr / x)
        if value.tensor is not None and not coeff.has(x):
            return coeff, Value(value.dims, value.tensor, value.axes)
        return sp.Integer(1), value

    # -- one operation ---------------------------------------------------------------------------
    def _operation(self, node: torch.fx.Node) -> object:
        target = node.target
        if target is operator.getitem:
            return self.values[node.args[0].name][node.args[1]]
        reader = READERS.get(target)
        if reader is None:
            packet = getattr(target, "_overloadpacket", None)
            reader = READERS.get(packet)
        if reader is None:
            raise self.refuse("an operation it can derive (this one is not in its vocabulary: "
                              "linear maps, products, sums, reshapes, elementwise functions, "
                              "softmax, layer_norm, rms_norm, scaled_dot_product_attention)")
        return reader(self, node, *node.args, **node.kwargs)

    # -- reshapes and views (no operation: the same tensor read another way) --------------------
    @reads(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.unflatten.int, aten.flatten.using_ints)
    def _read_view(self, node, source, *args, **kwargs) -> Value:
        value = self.value(source)
        leaves = [leaf for dim in self.leaf_dims(value) for leaf in dim]
        dims = regroup(leaves, self.shape_of(node))
        return Value(dims, value.tensor, value.axes, value.expr, value.constant,
                     value.transform)

    @reads(aten.transpose.int)
    def _read_transpose(self, node, source, a, b) -> Value:
        value = self.value(source)
        dims = list(value.dims)
        dims[a], dims[b] = dims[b], dims[a]
        return self._with_dims(value, dims)

    @reads(aten.permute.default)
    def _read_permute(self, node, source, order) -> Value:
        value = self.value(source)
        return self._with_dims(value, [value.dims[k] for k in order])

    @reads(aten.t.default, aten.numpy_T.default)
    def _read_t(self, node, source) -> Value:
        value = self.value(source)
        return self._with_dims(value, value.dims[::-1])

    @reads(aten.unsqueeze.default)
    def _read_unsqueeze(self, node, source, dim) -> Value:
        value = self.value(source)
        dims = list(value.dims)
        dims.insert(dim if dim >= 0 else len(dims) + dim + 1, [])
        return self._with_dims(value, dims)

    @reads(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
    def _read_squeeze(self, node, source, dims=None) -> Value:
        value = self.value(source)
        rank = len(value.dims)
        chosen = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
        dropped = {d % rank for d in chosen if not value.dims[d % rank]}
        return self._with_dims(value, [d for k, d in enumerate(value.dims) if k not in dropped])

    @reads(aten.expand.default, aten.broadcast_to.default)
    def _read_expand(self, node, source, shape, *args) -> Value:
        value = self.value(source)
        out = self.shape_of(node)
        dims = [[] for _ in range(len(out) - len(value.dims))] + list(value.dims)
        for k, extent in enumerate(out):
            if not dims[k] and extent != 1:
                dims[k] = [Axis(self.size((node.name, k), extent))]
        return self._with_dims(value, dims)

    @reads(aten.contiguous.default, aten.clone.default, aten.alias.default,
           aten.lift_fresh_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
           aten._to_copy.default, aten.type_as.default, aten.detach_.default)
    def _read_same(self, node, source, *args, **kwargs) -> Value:
        wide, narrow = source.meta["val"].dtype, node.meta["val"].dtype
        if (not self.narrowing and wide.is_floating_point and narrow.is_floating_point
                and torch.finfo(narrow).max < torch.finfo(wide).max):
            users = ", ".join(sorted({str(u.target).split(".")[-2].lstrip("_")
                                      for u in node.users if u.op == "call_function"}))
            self.narrowing = (f"{str(narrow).removeprefix('torch.')} (cast from "
                              f"{str(wide).removeprefix('torch.')}"
                              + (f" before {users})" if users else ")"))
        return self.value(source)

    @reads(aten.dropout.default, aten.native_dropout.default)
    def _read_dropout(self, node, source, p, train) -> Value:
        if train and p > 0:
            raise self.refuse(f"dropout off: the module is in training mode with p = {p} "
                              "(random); call module.eval() or set p = 0")
        return self.value(source)

    def _with_dims(self, value: Value, dims: list[list[Axis]]) -> Value:
        return Value(dims, value.tensor, value.axes, value.expr, value.constant, value.transform)

    # -- selections: slices, indices, concatenations --------------------------------------------
    def _select(self, key: str, value: Value, dim: int, details: tuple, out_extent) -> Value:
        """``value`` along ``dim`` multiplied by a selection table ``S[out, in]`` (the new
        tensor named after ``key``); a ``pick`` of one index drops the dimension."""
        dim = dim % len(value.dims)
        source = self.leaf_dims(value)[dim]
        pick = details[0] == "pick"
        out_dim = [] if pick else self.size((key, "selected"), out_extent).leaves()
        table = self.table("select", [[Axis(s) for s in out_dim],
                                      [Axis(a.size.root()) for a in source]], details)
        sizes, labels, term = self.through_table(value, dim, table, out_dim)
        terms = [term]
        if pick:  # the picked dimension is gone
            sizes, labels = sizes[:dim] + sizes[dim + 1:], labels[:dim] + labels[dim + 1:]
        return self.emit(sizes, labels, terms, key)

    def through_table(self, value: Value, dim: int, table: Value, out_dim: list[Size]
                      ) -> tuple[list, list, tuple]:
        """``value``'s dimension ``dim`` multiplied by ``table[out, in]`` (``out`` of the
        classes ``out_dim``): the result's sizes and labels, and the term."""
        leaves = self.leaf_dims(value)
        sizes = [[a.size.root() for a in d] for d in leaves]
        sizes[dim] = out_dim
        labels = self.out_labels(sizes)
        inner = [self.label() for _ in leaves[dim]]
        value_labels = [list(d) for d in labels]
        value_labels[dim] = inner
        coeff, base = self.scaled(value)
        return sizes, labels, (coeff, [self.operand(base, value_labels),
                                       self.operand(table, [labels[dim], inner])])

    def _chunk(self, key: str, value: Value, dim: int, count: int, k: int) -> Value | None:
        """Chunk ``k`` of ``count`` equal ones along ``dim``: the dimension factored into
        ``(count, rest)`` and index ``k`` picked along the first factor (a one-hot vector of
        ``count`` entries, where a selection table would be a product over the whole
        dimension); None where the dimension's factors cannot be cut there."""
        total = sp.Mul(*[a.extent for a in self.leaf_dims(value)[dim]])
        if count < 2 or not isinstance(total, int | sp.Integer) or int(total) % count:
            return None
        try:
            outer, _ = regroup(self.leaf_dims(value)[dim], [count, int(total) // count])
        except ShapeError:
            return None
        full = self.leaf_dims(value)[dim]
        outer, inner = full[:len(outer)], full[len(outer):]
        table = self.table("select", [[], [Axis(a.size.root()) for a in outer]], ("pick", k))
        sizes = [[a.size.root() for a in d] for d in self.leaf_dims(value)]
        sizes[dim] = [a.size.root() for a in inner]
        labels = self.out_labels(sizes)
        picked = [self.label() for _ in outer]
        value_labels = [list(d) for d in labels]
        value_labels[dim] = picked + labels[dim]
        coeff, base = self.scaled(value)
        return self.emit(sizes, labels, [(coeff, [self.operand(base, value_labels),
                                                  self.operand(table, [[], picked])])], key)

    @reads(aten.slice.Tensor)
    def _read_slice(self, node, source, dim=0, start=None, end=None, step=1) -> Value:
        value = self.value(source)
        dim = dim % len(value.dims)
        extent = self.shape_of(node)[dim]
        if extent == 0:
            return EMPTY
        full = self.leaf_dims(value)[dim]
        total = sp.Mul(*[a.extent for a in full]) if full else 1
        start, step = (self.values[v.name] if isinstance(v, torch.fx.Node) else v
                       for v in (start or 0, step))
        if start == 0 and step == 1 and sp.simplify(extent - total) == 0:
            return value  # the whole dimension
        if not isinstance(total, int | sp.Integer) or not all(
                isinstance(v, int) for v in (start, step)):
            raise self.refuse("a slice of fixed bounds along a dimension of fixed size")
        if step == 1 and isinstance(extent, int) and int(total) % extent == 0 and \
                start % extent == 0:  # one of equal chunks
            chunk = self._chunk(node.name, value, dim, int(total) // extent, start // extent)
            if chunk is not None:
                return chunk
        return self._select(node.name, value, dim, ("slice", int(start), int(step)), extent)

    @reads(aten.select.int)
    def _read_select_int(self, node, source, dim, index) -> Value:
        value = self.value(source)
        full = self.leaf_dims(value)[dim % len(value.dims)]
        total = sp.Mul(*[a.extent for a in full]) if full else 1
        if not isinstance(index, int) or not sp.sympify(total).is_Integer and index < 0:
            raise self.refuse("an index of fixed value")
        return self._select(node.name, value, dim, ("pick", int(index)), 1)

    @reads(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
    def _read_split(self, node, source, sizes, dim=0) -> tuple:
        value = self.value(source)
        dim = dim % len(value.dims)
        full = self.leaf_dims(value)[dim]
        total = int(sp.Mul(*[a.extent for a in full]))
        if node.target is aten.chunk.default:
            step = -(-total // sizes)
            sizes = [min(step, total - k) for k in range(0, total, step)]
        elif isinstance(sizes, int):
            sizes = [min(sizes, total - k) for k in range(0, total, sizes)]
        if len(set(sizes)) == 1:  # equal chunks
            chunks = [self._chunk(f"{node.name}_{k}", value, dim, len(sizes), k)
                      for k in range(len(sizes))]
            if all(chunk is not None for chunk in chunks):
                return tuple(chunks)
        out, start = [], 0
        for k, extent in enumerate(sizes):
            out.append(self._select(f"{node.name}_{k}", value, dim, ("slice", start, 1),
                                    extent))
            start += extent
        return tuple(out)

    @reads(aten.unbind.int)
    def _read_unbind(self, node, source, dim=0) -> tuple:
        value = self.value(source)
        full = self.leaf_dims(value)[dim % len(value.dims)]
        count = int(sp.Mul(*[a.extent for a in full])) if full else 1
        return tuple(self._select(f"{node.name}_{k}", value, dim, ("pick", k), 1)
                     for k in range(count))

    @reads(aten.stack.default)
    def _read_stack(self, node, sources, dim=0) -> Value:
        """``stack``: each input given a new dimension of one at ``dim``, then concatenated
        there."""
        values = [self.value(s) for s in sources]
        at = dim % (len(values[0].dims) + 1)
        return self._concatenated(node, [self._with_dims(v, v.dims[:at] + [[]] + v.dims[at:])
                                         for v in values], at)

    @staticmethod
    def _zeros(node: torch.fx.Node) -> bool:
        """Whether ``node`` makes a tensor of zeros (``torch.zeros``, ``new_zeros``, a fill
        with 0)."""
        if node.target in (aten.zeros.default, aten.new_zeros.default,
                           aten.zeros_like.default):
            return True
        fills = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
        at = fills.get(node.target)
        return at is not None and len(node.args) > at and node.args[at] == 0

    @reads(aten.cat.default)
    def _read_cat(self, node, sources, dim=0) -> Value:
        kept = [s for s in sources if self.values.get(s.name) is not EMPTY
                and self.shape_of(s) != [0]]  # torch.cat skips a 1-d empty tensor too
        values = [self.value(s) for s in kept]
        if len(values) == 1:
            return values[0]
        zeros = {k for k, s in enumerate(kept) if self._zeros(s) and s.name not in
                 self.differentiable}
        return self._concatenated(node, values, dim % len(values[0].dims), zeros)

    def _concatenated(self, node, values: list[Value], dim: int,
                      zeros: set[int] = frozenset()) -> Value:
        """``values`` placed one after another along ``dim`` (each by a constant placement
        table, counted from the end where a size bound at call time comes before it), every
        other dimension aligned as by broadcasting; the pieces ``zeros`` (constant zeros)
        only take their place."""
        out_extent = self.shape_of(node)[dim]
        out_size = self.size((node.name, "cat"), out_extent).leaves()
        others = [self._with_dims(v, v.dims[:dim] + v.dims[dim + 1:])
                  for k, v in enumerate(values) if k not in zeros]
        sizes, (labels, *per_value) = self.broadcast(others)
        per_value = iter(per_value)
        out_label = [self.label() for _ in out_size]
        out_sizes = sizes[:dim] + [out_size] + sizes[dim:]
        out_labels = labels[:dim] + [out_label] + labels[dim:]
        extents = [sp.Mul(*[a.extent for a in self.leaf_dims(v)[dim]]) for v in values]
        terms = []
        for k, value in enumerate(values):
            if k in zeros:
                continue
            own = next(per_value)
            part = self.leaf_dims(value)[dim]
            before, after = sum(extents[:k]), sum(extents[k + 1:])
            if sp.sympify(before).is_Integer:
                place = ("place", int(before))
            elif sp.sympify(after).is_Integer:  # placed from the end
                place = ("place_end", int(after))
            else:
                raise self.refuse("a concatenation whose pieces have fixed sizes but one")
            inner = [self.label() for _ in part]
            table = self.table(place[0], [[Axis(s) for s in out_size],
                                          [Axis(a.size.root()) for a in part]], place)
            coeff, base = self.scaled(value)
            terms.append((coeff, [self.operand(base, own[:dim] + [inner] + own[dim:]),
                                  self.operand(table, [out_label, inner])]))
        return self.emit(out_sizes, out_labels, terms)

    @reads(aten.index.Tensor)
    def _read_index(self, node, source, indices) -> Value:
        """``source[..., idx, ...]`` with one constant index tensor ``idx`` (the others
        ``None``): the product with the one-hot rows of ``idx``, as an embedding."""
        value = self.value(source)
        at = [k for k, index in enumerate(indices) if index is not None]
        if len(at) != 1:
            raise self.refuse("an index by one tensor along one dimension")
        dim = at[0]
        ids = self.value(indices[dim])
        full = self.leaf_dims(value)[dim]  # one axis, or its factors (row-major)
        if ids.constant is None or ids.constant == TOKENS or not full or not all(
                isinstance(a.extent, int) for a in full):
            raise self.refuse("an index by a constant integer tensor along a dimension of "
                              "fixed size")
        total = math.prod(a.extent for a in full)
        # the dimension's own axes (their classes, split or not later, keep its factors)
        hot = Value(ids.dims + [[Axis(a.size.root()) for a in value.dims[dim]]],
                    constant=ids.constant, transform=f"index:{total}")
        return self._by_rows(value, dim, hot)

    def _by_rows(self, value: Value, dim: int, hot: Value) -> Value:
        """``value``'s dimension ``dim`` (an axis or its factors) contracted with the last of
        ``hot`` (one-hot rows over the same factors): ``out[.., i.., ..] = Σ_r hot[i.., r]
        value[.., r, ..]``, ``hot``'s other dimensions in place of ``dim``."""
        sizes = [[a.size.root() for a in d] for d in self.leaf_dims(value)]
        picked = [[a.size.root() for a in d] for d in self.leaf_dims(hot)[:-1]]
        out_sizes = sizes[:dim] + picked + sizes[dim + 1:]
        labels = self.out_labels(out_sizes)
        inner = [self.label() for _ in sizes[dim]]
        return self.emit(out_sizes, labels, [(sp.Integer(1), [
            self.operand(value, labels[:dim] + [inner] + labels[dim + len(picked):]),
            self.operand(hot, labels[dim:dim + len(picked)] + [inner])])])

    @reads(aten.embedding.default)
    def _read_embedding(self, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                        sparse=False) -> Value:
        """The table's rows picked by the indices: the product with their one-hot rows. The
        row ``padding_idx`` is read as torch's backward has it, as a constant (no derivative
        flows into it): a zero one-hot row, the table's row added at call time."""
        if scale_grad_by_freq:
            raise self.refuse("an embedding without scale_grad_by_freq (its backward divides "
                              "each row's gradient by how often its index occurs in the batch, "
                              "which is no derivative of the forward)")
        table = self.value(weight)
        ids = self.value(indices)
        rows = self.leaf_dims(table)[0]
        if len(rows) != 1:
            raise self.refuse("an embedding table with one row axis")
        padding = f":{padding_idx}" if padding_idx >= 0 else ""
        if ids.constant == TOKENS:
            picked = self._embedded_tokens(table, ids, padding_idx)
        elif ids.constant is None:
            raise self.refuse("embedding indices that do not depend on X or the parameters")
        else:
            hot = Value(ids.dims + [[Axis(rows[0].size.root())]], constant=ids.constant,
                        transform=f"one_hot:{rows[0].extent}{padding}")
            picked = self._by_rows(table, 0, hot)
        if not padding:
            return picked
        if table.tensor is None or not isinstance(weight, torch.fx.Node):
            raise self.refuse("an embedding table that is a tensor of the module")
        width = self.leaf_dims(table)[1]
        constant = Value(ids.dims + [[Axis(a.size.root()) for a in width]],
                         constant=(indices.name, weight.name), transform=f"padding{padding}")
        return self.combine([picked, constant], [(1, [0]), (1, [1])])

    def _embedded_tokens(self, table: Value, ids: Value, padding_idx: int = -1) -> Value:
        """``X W`` with ``X`` the one-hot rows of the token ids (one per id, over the
        vocabulary: the table's rows; the row of ``padding_idx``'s id all zeros)."""
        rows = self.leaf_dims(table)[0]
        if len(rows) != 1 or "X" in self.inputs:
            raise self.refuse("token ids read by one embedding table of one row axis")
        vocabulary = rows[0].size.root()
        self.hints[vocabulary] = "V"
        dims = self.leaf_dims(ids) + [[Axis(vocabulary)]]
        X = Value(dims, "X", [a for dim in dims for a in dim])
        self.inputs["X"] = ("input", X)
        self._tensor_axes["X"] = X.axes
        self.vocabulary = int(vocabulary.extent)
        self.padding = padding_idx if padding_idx >= 0 else None
        return self._by_rows(table, 0, X)

    # -- elementwise ---------------------------------------------------------------------------
    def _unary(self, source, fn: Callable[[sp.Expr], sp.Expr]) -> Value:
        value = self.value(source)
        return Value(value.dims, value.tensor, value.axes, fn(value.expr), value.constant,
                     value.transform, (self.node.name, self.what(), self.where()))

    def _same_tensor(self, a: Value, b: Value) -> bool:
        """Whether ``a`` and ``b`` read one tensor the same way (so an elementwise operation
        of the two is a function of that tensor)."""
        return (a.tensor is not None and a.tensor == b.tensor and len(a.dims) == len(b.dims)
                and all([id(x_) for x_ in da] == [id(y_) for y_ in db]
                        for da, db in zip(self.leaf_dims(a), self.leaf_dims(b))))

    def _binary(self, node, a, b, op: str, alpha=1) -> object:
        """``a op b`` for ``op`` in ``+ - * /`` (``alpha`` scaling ``b`` of a sum)."""
        numbers = {k: v for k, v in (("a", a), ("b", b)) if not isinstance(v, torch.fx.Node)}
        if numbers:
            try:
                number = _number(numbers.get("a", numbers.get("b")))
            except (TypeError, ValueError):
                raise self.refuse(f"a finite number, got {numbers}") from None
            value = self.value(b if "a" in numbers else a)
            fn = {"+": lambda e: e + alpha * number if "a" not in numbers else number + alpha * e,
                  "-": lambda e: e - alpha * number if "a" not in numbers else number - alpha * e,
                  "*": lambda e: e * number,
                  "/": lambda e: e / number if "a" not in numbers else number / e}[op]
            return Value(value.dims, value.tensor, value.axes, fn(value.expr), value.constant,
                         value.transform, (node.name, self.what(), self.where()))
        first, second = self.value(a), self.value(b)
        if self._same_tensor(first, second):
            fa, fb = first.expr, second.expr
            expr = {"+": fa + alpha * fb, "-": fa - alpha * fb, "*": fa * fb, "/": fa / fb}[op]
            return Value(first.dims, first.tensor, first.axes, expr,
                         origin=(node.name, self.what(), self.where()))
        alpha = _number(alpha)
        if op in "+-":
            sign = alpha if op == "+" else -alpha
            ca, va = self.scaled(first)
            cb, vb = self.scaled(second)
            return self.combine([va, vb], [(ca, [0]), (sign * cb, [1])])
        if op == "/":
            second = Value(second.dims, second.tensor, second.axes, 1 / second.expr,
                           second.constant, second.transform)
        ca, va = self.scaled(first)
        cb, vb = self.scaled(second)
        return self.combine([va, vb], [(ca * cb, [0, 1])])

    @reads(aten.add.Tensor, aten.add.Scalar)
    def _read_add(self, node, a, b, alpha=1) -> Value:
        return self._binary(node, a, b, "+", alpha)

    @reads(aten.sub.Tensor, aten.sub.Scalar)
    def _read_sub(self, node, a, b, alpha=1) -> Value:
        return self._binary(node, a, b, "-", alpha)

    @reads(aten.rsub.Scalar, aten.rsub.Tensor)
    def _read_rsub(self, node, a, b, alpha=1) -> Value:
        return self._binary(node, b, a, "-", alpha)

    @reads(aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
           aten.add_.Scalar, aten.sub_.Scalar, aten.mul_.Scalar, aten.div_.Scalar)
    def _read_in_place(self, node, a, *args, **kwargs) -> Value:
        """``a.op_(b)`` as ``a op b``, ``a`` read as its result from then on: where nothing
        read ``a`` before (no view of it can see the change)."""
        order = {n: k for k, n in enumerate(self.graph.nodes)}
        if not isinstance(a, torch.fx.Node) or a.op == "placeholder" or any(
                order[user] < order[node] for user in a.users if user is not node):
            raise self.refuse("an in-place operation on a tensor nothing read before")
        name = str(node.target._overloadpacket).removeprefix("aten.").rstrip("_")
        result = READERS[getattr(aten, name).Tensor](self, node, a, *args, **kwargs)
        self.values[a.name] = result
        return result

    @reads(aten.mul.Tensor, aten.mul.Scalar, operator.mul)
    def _read_mul(self, node, a, b) -> Value:
        return self._binary(node, a, b, "*")

    @reads(aten.div.Tensor, aten.div.Scalar)
    def _read_div(self, node, a, b) -> Value:
        return self._binary(node, a, b, "/")

    @reads(aten.neg.default)
    def _read_neg(self, node, source) -> Value:
        return self._unary(source, lambda e: -e)

    @reads(aten.pow.Tensor_Scalar)
    def _read_pow(self, node, source, exponent) -> Value:
        return self._unary(source, lambda e: e ** _number(exponent))

    @reads(aten.square.default)
    def _read_square(self, node, source) -> Value:
        return self._unary(source, lambda e: e ** 2)

    @reads(aten.rsqrt.default)
    def _read_rsqrt(self, node, source) -> Value:
        return self._unary(source, lambda e: e ** sp.Rational(-1, 2))

    @reads(aten.sqrt.default)
    def _read_sqrt(self, node, source) -> Value:
        return self._unary(source, sp.sqrt)

    @reads(aten.reciprocal.default)
    def _read_reciprocal(self, node, source) -> Value:
        return self._unary(source, lambda e: 1 / e)

    @reads(aten.exp.default)
    def _read_exp(self, node, source) -> Value:
        return self._unary(source, sp.exp)

    @reads(aten.log.default)
    def _read_log(self, node, source) -> Value:
        return self._unary(source, sp.log)

    @reads(aten.tanh.default)
    def _read_tanh(self, node, source) -> Value:
        return self._unary(source, sp.tanh)

    @reads(aten.sigmoid.default)
    def _read_sigmoid(self, node, source) -> Value:
        return self._unary(source, sigmoid)

    @reads(aten.erf.default)
    def _read_erf(self, node, source) -> Value:
        return self._unary(source, sp.erf)

    @reads(aten.sin.default)
    def _read_sin(self, node, source) -> Value:
        return self._unary(source, sp.sin)

    @reads(aten.cos.default)
    def _read_cos(self, node, source) -> Value:
        return self._unary(source, sp.cos)

    @reads(aten.relu.default)
    def _read_relu(self, node, source) -> Value:
        return self._unary(source, lambda e: sp.Max(e, 0))

    @reads(aten.silu.default)
    def _read_silu(self, node, source) -> Value:
        return self._unary(source, lambda e: e * sigmoid(e))

    @reads(aten.gelu.default)
    def _read_gelu(self, node, source, approximate="none") -> Value:
        if approximate == "tanh":
            return self._unary(source, lambda e: e * (1 + sp.tanh(
                sp.sqrt(2 / sp.pi) * (e + sp.Rational(44715, 1000000) * e ** 3))) / 2)
        return self._unary(source, lambda e: e * (1 + sp.erf(e / sp.sqrt(2))) / 2)

    @reads(aten.softplus.default)
    def _read_softplus(self, node, source, beta=1, threshold=20) -> Value:
        beta = _number(beta)
        return self._unary(source, lambda e: softplus(beta * e) / beta)

    @reads(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
    def _read_where(self, node, condition, a, b) -> Value:
        """``where(m, a, b)`` as ``a·m + b·(1 - m)``, each product with its own 0/1 mask (exact:
        ``a + b - b`` would lose ``a`` beside ``b = finfo.min``); a branch that is a constant
        (a fill value, a tensor of them) is made at call time with the mask, as torch does,
        so that no derivative flows where the forward took it."""
        mask = self.value(condition)
        if mask.constant is None:
            raise self.refuse("a condition that does not depend on X or the parameters")
        branches, made = [], []
        for arg, taken in ((a, "float"), (b, "not")):
            if not isinstance(arg, torch.fx.Node):
                made.append(self._filled(mask, arg, "fill" if taken == "float" else "fill_not"))
                continue
            value = self.value(arg)
            if value.tensor is None and value.expr == x and value.transform == "same":
                made.append(self.made([mask, value], "then" if taken == "float" else "else"))
            else:
                branches.append((value, Value(mask.dims, constant=mask.constant,
                                              transform=taken)))
        values = [v for pair in branches for v in pair] + made
        terms = [(1, [2 * k, 2 * k + 1]) for k in range(len(branches))]
        terms += [(1, [2 * len(branches) + k]) for k in range(len(made))]
        return self.combine(values, terms)

    def _filled(self, mask: Value, fill: object, transform: str) -> Value:
        """The number ``fill`` where ``mask`` is true (``fill_not``: false), 0 elsewhere."""
        if not isinstance(fill, int | float) or math.isnan(fill):
            raise self.refuse(f"a number to fill with, got {fill!r}")
        return Value(mask.dims, constant=mask.constant, transform=f"{transform}:{float(fill)!r}")

    def made(self, values: list[Value], transform: str) -> Value:
        """A constant made at call time from the values of the constants ``values`` (each the
        value of its node) by ``transform``; its dimensions are theirs, broadcast."""
        sizes, _ = self.broadcast(values)
        return Value([[Axis(size) for size in dim] for dim in sizes],
                     constant=tuple(v.constant for v in values), transform=transform)

    @reads(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
    def _read_masked_fill(self, node, source, mask, fill) -> Value:
        """``x·(1 - m) + c·m`` with ``c·m`` made at call time: the filled entries have no
        derivative, as in torch. An infinite fill is added (``x - inf`` is ``-inf`` where
        ``x·0 - inf`` would be too, but a second mask's ``-inf·0`` would not)."""
        value, where = self.value(source), self.value(mask)
        if where.constant is None:
            raise self.refuse("a mask that does not depend on X or the parameters")
        if isinstance(fill, torch.fx.Node):
            filler = self.value(fill)
            if filler.tensor is not None or filler.expr != x or filler.transform != "same":
                raise self.refuse("a fill value that does not depend on X or the parameters")
            filled = self.made([where, filler], "then")
        else:
            filled = self._filled(where, fill, "fill")
        coeff, base = self.scaled(value)
        if isinstance(fill, float) and math.isinf(fill):
            return self.combine([base, filled], [(coeff, [0]), (1, [1])])
        kept = Value(where.dims, constant=where.constant, transform="not")
        return self.combine([base, kept, filled], [(coeff, [0, 1]), (1, [2])])

    # -- reductions ------------------------------------------------------------------------------
    def _reduce(self, node, source, dims, keepdim: bool, mean: bool) -> Value:
        value = self.value(source)
        rank = len(value.dims)
        dims = range(rank) if dims is None or dims == [] else [dims] if isinstance(
            dims, int) else dims
        reduced = {d % rank for d in dims}
        leaves = self.leaf_dims(value)
        if any(self.is_batch(a) for d in reduced for a in leaves[d]):
            raise self.refuse("a sum over the features of each sample, not over the batch")
        sizes = [[a.size.root() for a in dim] for dim in leaves]
        out_sizes = [([] if k in reduced else s) for k, s in enumerate(sizes) if
                     keepdim or k not in reduced]
        labels = self.out_labels(out_sizes)
        value_labels, position = [], 0
        for k, dim in enumerate(leaves):
            if k in reduced:
                value_labels.append([self.label() for _ in dim])
                if keepdim:
                    position += 1
            else:
                value_labels.append(labels[position])
                position += 1
        count = sp.Mul(*[_symbol(a.size) for d in reduced for a in leaves[d]])
        coeff, base = self.scaled(value)
        if mean:
            coeff = coeff / count
        return self.emit(out_sizes, labels, [(coeff, [self.operand(base, value_labels)])])

    @reads(aten.mean.dim, aten.mean.default)
    def _read_mean(self, node, source, dims=None, keepdim=False, **kwargs) -> Value:
        return self._reduce(node, source, dims, keepdim, mean=True)

    @reads(aten.sum.dim_IntList, aten.sum.default)
    def _read_sum(self, node, source, dims=None, keepdim=False, **kwargs) -> Value:
        return self._reduce(node, source, dims, keepdim, mean=False)

    # -- linear maps ---------------------------------------------------------------------------
    def _linear(self, node, source, weight, bias, transposed: bool) -> Value:
        """``source W^T + b`` (``W`` of shape ``(out, in)``; ``(in, out)`` when
        ``transposed``)."""
        x_value, w_value = self.value(source), self.value(weight)
        if len(w_value.dims) != 2:
            raise self.refuse("a weight matrix of two dimensions")
        w_in, w_out = (1, 0) if not transposed else (0, 1)
        x_leaves = self.leaf_dims(x_value)
        align([a.size for a in x_leaves[-1]], [a.size for a in self.leaf_dims(w_value)[w_in]])
        x_leaves = self.leaf_dims(x_value)
        w_leaves = self.leaf_dims(w_value)
        sizes = [[a.size.root() for a in d] for d in x_leaves[:-1]]
        out = [a.size.root() for a in w_leaves[w_out]]
        labels = self.out_labels(sizes + [out])
        inner = [self.label() for _ in x_leaves[-1]]
        w_labels = [labels[-1], inner] if not transposed else [inner, labels[-1]]
        cx, vx = self.scaled(x_value)
        terms = [(cx, [self.operand(vx, labels[:-1] + [inner]), self.operand(w_value, w_labels)])]
        if bias is not None:
            b_value = self.value(bias)
            if len(b_value.dims) != 1:
                raise self.refuse("a bias of one dimension")
            align([a.size for a in self.leaf_dims(b_value)[0]], out)
            terms.append((sp.Integer(1), [self.operand(b_value, [labels[-1]])]))
        return self.emit(sizes + [out], labels, terms)

    @reads(aten.linear.default)
    def _read_linear(self, node, source, weight, bias=None) -> Value:
        return self._linear(node, source, weight, bias, transposed=False)

    @reads(aten.addmm.default)
    def _read_addmm(self, node, bias, source, weight, beta=1, alpha=1) -> Value:
        if beta != 1 or alpha != 1:
            raise self.refuse("addmm with beta = alpha = 1")
        return self._linear(node, source, weight, bias, transposed=True)

    @reads(aten.matmul.default, aten.mm.default, aten.bmm.default)
    def _read_matmul(self, node, a, b) -> Value:
        first, second = self.value(a), self.value(b)
        if len(first.dims) < 2 or len(second.dims) < 2:
            raise self.refuse("matrix products of tensors with two or more dimensions")
        # batch dimensions broadcast; the last of a meets the second-to-last of b
        fa = self._with_dims(first, first.dims[:-2])
        fb = self._with_dims(second, second.dims[:-2])
        align([s.size for s in self.leaf_dims(first)[-1]],
              [s.size for s in self.leaf_dims(second)[-2]])
        batch_sizes, (batch_labels, la, lb) = self.broadcast([fa, fb])
        rows = [a_.size.root() for a_ in self.leaf_dims(first)[-2]]
        cols = [a_.size.root() for a_ in self.leaf_dims(second)[-1]]
        inner = [self.label() for _ in self.leaf_dims(first)[-1]]
        out_sizes = batch_sizes + [rows, cols]
        out_labels = batch_labels + self.out_labels([rows, cols])
        ca, va = self.scaled(first)
        cb, vb = self.scaled(second)
        return self.emit(out_sizes, out_labels, [(ca * cb, [
            self.operand(va, la + [out_labels[-2], inner]),
            self.operand(vb, lb + [inner, out_labels[-1]])])])

    @reads(aten.conv2d.default, aten.convolution.default)
    def _read_conv2d(self, node, source, weight, bias=None, stride=(1, 1), padding=(0, 0),
                     dilation=(1, 1), groups=1, *rest) -> Value:
        x_value, w_value = self.value(source), self.value(weight)
        kernel = [int(e) for e in self.shape_of(weight)[2:]]
        stride = list(stride) if isinstance(stride, list | tuple) else [stride] * 2
        padding = list(padding) if isinstance(padding, list | tuple) else [padding] * 2
        if (len(x_value.dims) != 4 or stride != kernel or any(padding) or groups != 1
                or any(d != 1 for d in dilation)):
            raise self.refuse("a convolution that cuts images into patches (kernel = stride, "
                              "no padding, no dilation, one group)")
        out_shape = self.shape_of(node)
        # split each image axis into (patches, kernel)
        image = [regroup(self.leaf_dims(x_value)[k], [out_shape[k], kernel[k - 2]])
                 for k in (2, 3)]  # each image axis as (patches, kernel)
        leaves = self.leaf_dims(x_value)
        w_leaves = self.leaf_dims(w_value)
        align([a.size for a in leaves[1]], [a.size for a in w_leaves[1]])
        align([image[0][1][0].size], [a.size for a in w_leaves[2]])
        align([image[1][1][0].size], [a.size for a in w_leaves[3]])
        leaves = self.leaf_dims(x_value)
        w_leaves = self.leaf_dims(w_value)
        batch = [a.size.root() for a in leaves[0]]
        channels_out = [a.size.root() for a in w_leaves[0]]
        patches = [[a.size.root() for a in g[0]] for g in image]
        out_sizes = [batch, channels_out, *patches]
        labels = self.out_labels(out_sizes)
        c = [self.label() for _ in leaves[1]]
        kh, kw = self.label(), self.label()
        x_labels = [labels[0], c, labels[2] + [kh], labels[3] + [kw]]
        terms = [(sp.Integer(1), [self.operand(x_value, x_labels),
                                  self.operand(w_value, [labels[1], c, [kh], [kw]])])]
        if bias is not None:
            terms.append((sp.Integer(1), [self.operand(self.value(bias), [labels[1]])]))
        return self.emit(out_sizes, labels, terms)

    # -- softmax, normalisation, attention ------------------------------------------------------
    def softmax(self, value: Value, dim: int, hint: str) -> Value:
        """The engine's softmax of ``value`` over ``dim`` (one axis)."""
        rank = len(value.dims)
        dim %= rank
        leaves = self.leaf_dims(value)
        if len(leaves[dim]) != 1:
            raise self.refuse("a softmax over one axis")
        order = [k for k in range(rank) if k != dim] + [dim]
        wanted = [a for k in order for a in leaves[k] if not self.is_batch(a)]
        if (value.tensor is None or value.expr != x or [id(a) for a in wanted]
                != [id(a) for a in self.axes_of(value.tensor)]):
            sizes = [[a.size.root() for a in leaves[k]] for k in order]
            labels = self.out_labels(sizes)
            value_labels: list = [None] * rank
            for position, k in enumerate(order):
                value_labels[k] = labels[position]
            coeff, base = self.scaled(value)
            copied = self.emit(sizes, labels, [(coeff, [self.operand(base, value_labels)])],
                               f"{hint}_scores")
            dims: list = [None] * rank
            for position, k in enumerate(order):
                dims[k] = copied.dims[position]
            value = Value(dims, copied.tensor, copied.axes)
        source = self.axes_of(value.tensor)
        labels = [self.label() for _ in source]
        name = self.name(hint)
        axes = [Axis(a.size.root()) for a in source]
        self.ops.append(dict(kind="softmax", out=name, labels=labels,
                             axes=list(zip(labels, [a.size.root() for a in source])),
                             source=(value.tensor, labels), what="softmax",
                             path=self.where()))
        self._tensor_axes[name] = axes
        mapping = {id(s): a for s, a in zip(source, axes)}
        dims = [[mapping.get(id(a), a) for a in dim] for dim in self.leaf_dims(value)]
        batch = [a for dim in dims for a in dim if self.is_batch(a)]
        return Value(dims, name, batch[:1] + axes)

    @reads(aten.softmax.int, aten._softmax.default)
    def _read_softmax(self, node, source, dim, *rest, **kwargs) -> Value:
        value = self.value(source)
        if not self.leaf_dims(value)[dim % len(value.dims)]:  # over one entry: 1, a constant
            return Value(value.dims, constant=node.name)
        return self.softmax(value, dim, node.name)

    def _normalise(self, node, source, count: int, eps: float, centred: bool,
                   weight=None, bias=None, offset: float = 0) -> Value:
        """``(x - mean) / sqrt(var + eps)`` (or ``x / sqrt(mean(x²) + eps)``) over the last
        ``count`` dimensions, times ``weight + offset``, plus ``bias``."""
        value = self.value(source)
        leaves = self.leaf_dims(value)
        sizes = [[a.size.root() for a in d] for d in leaves]
        rows, features = sizes[:-count], sizes[-count:]
        if any(self.is_batch(a) for d in leaves[-count:] for a in d):
            raise self.refuse("a normalisation over the features of each sample")
        row_labels = self.out_labels(rows)
        feature_labels = [[self.label() for _ in d] for d in features]
        every = row_labels + feature_labels
        n = sp.Mul(*[_symbol(s) for d in features for s in d])
        coeff, base = self.scaled(value)
        name = node.name
        if centred:
            mean = self.emit(rows, row_labels, [(coeff / n, [self.operand(base, every)])],
                             f"{name}_mean")
            spread_of = self.emit(sizes, every, [(coeff, [self.operand(base, every)]),
                                                 (-1, [self.operand(mean, row_labels)])],
                                  f"{name}_centred")
            spread_coeff = sp.Integer(1)
        else:
            spread_of, spread_coeff = base, coeff
        spread = self.emit(rows, row_labels, [(spread_coeff ** 2 / n, [
            self.operand(spread_of, every), self.operand(spread_of, every)])],
            f"{name}_var" if centred else f"{name}_meansquare")
        eps = _number(eps)
        if eps == 0:
            self.guards.append((spread.tensor, mean.tensor if centred else spread.tensor,
                                f"{'LayerNorm' if centred else 'RMSNorm'} at "
                                f"{_path(node) or 'the module'} has eps = 0 and needs every "
                                "row variance > 0, but a row of its input is constant; "
                                "change the input or use eps > 0"))
        rsqrt = Value(spread.dims, spread.tensor, spread.axes, (x + eps) ** sp.Rational(-1, 2),
                      origin=(f"{name}_rsqrt", "rsqrt", self.where()))
        terms = [(spread_coeff, [self.operand(spread_of, every),
                                 self.operand(rsqrt, row_labels)])]
        normalised = self.emit(sizes, every, terms, f"{name}_normalised"
                               if weight is not None else name)
        if weight is None:
            return normalised
        w = self.value(weight)
        out_terms = [(sp.Integer(1), [self.operand(w, feature_labels),
                                      self.operand(normalised, every)])]
        if offset:
            out_terms.append((_number(offset), [self.operand(normalised, every)]))
        if bias is not None:
            out_terms.append((sp.Integer(1), [self.operand(self.value(bias), feature_labels)]))
        return self.emit(sizes, every, out_terms, name)

    @reads(aten.layer_norm.default)
    def _read_layer_norm(self, node, source, shape, weight=None, bias=None, eps=1e-5,
                         *rest) -> Value:
        return self._normalise(node, source, len(shape), eps, True, weight, bias)

    @reads(aten.rms_norm.default)
    def _read_rms_norm(self, node, source, shape, weight=None, eps=None) -> Value:
        if eps is None:
            eps = torch.finfo(node.args[0].meta["val"].dtype).eps
        return self._normalise(node, source, len(shape), eps, False, weight)

    @reads(aten.scaled_dot_product_attention.default)
    def _read_sdpa(self, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False) -> Value:
        if dropout_p:
            raise self.refuse(f"attention dropout off (dropout_p = {dropout_p}: training "
                              "mode?); call module.eval()")
        Q, K, V = self.value(q), self.value(k), self.value(v)
        if len(Q.dims) < 2 or len(K.dims) != len(Q.dims) or len(V.dims) != len(Q.dims):
            raise self.refuse("queries, keys and values of equal rank")
        if enable_gqa and len(Q.dims) >= 3:
            qh, kh = self.leaf_dims(Q)[-3], self.leaf_dims(K)[-3]
            ratio = (int(sp.Mul(*[a.extent for a in qh]))
                     // int(sp.Mul(*[a.extent for a in kh])))
            if ratio > 1:  # query head (kv head, member of its group)
                shared = self.size((node.name, "gqa"), ratio)
                align([a.size for a in qh], [a.size for a in kh] + [shared])
                K = self._with_dims(K, K.dims[:-3] + [K.dims[-3] + [Axis(shared)]]
                                    + K.dims[-2:])
                V = self._with_dims(V, V.dims[:-3] + [V.dims[-3] + [Axis(shared)]]
                                    + V.dims[-2:])
        align([a.size for a in self.leaf_dims(Q)[-1]], [a.size for a in self.leaf_dims(K)[-1]])
        align([a.size for a in self.leaf_dims(K)[-2]], [a.size for a in self.leaf_dims(V)[-2]])
        batch_sizes, (batch_labels, lq, lk, lv) = self.broadcast(
            [self._with_dims(t, t.dims[:-2]) for t in (Q, K, V)])
        query, key = self.leaf_dims(Q)[-2], self.leaf_dims(K)[-2]
        width, value_width = self.leaf_dims(Q)[-1], self.leaf_dims(V)[-1]
        for leaves, hint in ((width, "d_k"), (value_width, "d_v")):
            for a in leaves:
                self.hints.setdefault(a.size.root(), hint)
        for dim in batch_sizes[-1:]:
            for size, hint in zip(dim, ("h",) if len(dim) == 1 else ("g", "r")):
                self.hints.setdefault(size.root(), hint)
        i = self.out_labels([[a.size.root() for a in query]])[0]
        j = self.out_labels([[a.size.root() for a in key]])[0]
        e = [self.label() for _ in width]
        f = self.out_labels([[a.size.root() for a in value_width]])[0]
        if scale is None:
            scale = 1 / sp.sqrt(sp.Mul(*[_symbol(a.size) for a in width]))
        else:
            scale = _number(scale)
        # one key (a sequence of length 1): its softmax weight is 1 (0 where a mask drops it)
        single = not key
        cq, vq = self.scaled(Q)
        ck, vk = self.scaled(K)
        score_sizes = batch_sizes + [[a.size.root() for a in query], [a.size.root() for a in key]]
        scores = None if single else self.emit(score_sizes, batch_labels + [i, j], [(
            scale * cq * ck, [self.operand(vq, lq + [i, e]), self.operand(vk, lk + [j, e])])],
            f"{node.name}_scores")
        kept = None
        if attn_mask is not None and self.value(attn_mask).constant is None:
            # a mask computed from the parameters (a relative-position bias): a term of the
            # scores like any other
            if not single:
                cm, vm = self.scaled(self.value(attn_mask))
                scores = self.combine([scores, vm], [(1, [0]), (cm, [1])],
                                      f"{node.name}_biased")
        elif attn_mask is not None:
            mask = self.value(attn_mask)
            # a row with every key masked attends to nothing (torch's safe softmax): its
            # mask is zero and its output multiplied by 0
            boolean = attn_mask.meta["val"].dtype == torch.bool
            kept = Value(mask.dims[:-1] + [[]], constant=mask.constant,
                         transform="rows_kept" if boolean else "rows_finite")
            mask = Value(mask.dims, constant=mask.constant,
                         transform="additive_keep" if boolean else "additive_safe")
            if not single:
                scores = self.combine([scores, mask], [(1, [0]), (1, [1])],
                                      f"{node.name}_masked")
        if is_causal and not single:
            leaves = self.leaf_dims(scores)
            causal = self.table("causal", [[Axis(a.size.root()) for a in leaves[-2]],
                                           [Axis(a.size.root()) for a in leaves[-1]]], ())
            scores = self.combine([scores, causal], [(1, [0]), (1, [1])], f"{node.name}_causal")
        weights = None if single else self.softmax(scores, -1, f"{node.name}_weights")
        # (one key: Q's batch dimensions stand in for the weights' in the broadcast)
        factors = [self._with_dims(Q, Q.dims[:-2] + [[], []]) if single else weights, V] + (
            [kept] if kept is not None else [])
        sizes, (labels, *batch_labels) = self.broadcast(
            [self._with_dims(t, t.dims[:-2]) for t in factors])
        rows = self.out_labels([[a.size.root() for a in query]])[0]
        keys = [self.label() for _ in key]
        cv, vv = self.scaled(V)
        out_sizes = sizes + [[a.size.root() for a in query], [a.size.root() for a in value_width]]
        operands = ([] if single else [self.operand(weights, batch_labels[0] + [rows, keys])]
                    ) + [self.operand(vv, batch_labels[1] + [keys, f])]
        if kept is not None:
            query_dim = rows if self.leaf_dims(kept)[-2] else []  # a mask broadcast over rows
            operands.append(self.operand(kept, batch_labels[2] + [query_dim, []]))
        return self.emit(out_sizes, labels + [rows, f], [(cv, operands)], node.name)

    # -- the program -----------------------------------------------------------------------------
    def _finish(self, output: Value) -> Reading:
        """The program of this pass: sizes named, inputs, operations and output written out."""
        if "X" not in self.inputs:
            raise UnsupportedOperation(f"{self.root or 'the module'}: expected its token ids "
                                       "(X) read by an embedding")
        output = self.held(output)
        leaves = self.leaf_dims(output)
        batch = [k for k, dim in enumerate(leaves) if any(self.is_batch(a) for a in dim)]
        if len(batch) != 1 or len(leaves[batch[0]]) != 1:
            raise UnsupportedOperation(f"{self.root or 'the module'}'s output: expected the "
                                       "batch as a dimension of its own")
        at = batch[0]
        wanted = [a for k, dim in enumerate(leaves) if k != at for a in dim]
        if [id(a) for a in wanted] != [id(a) for a in self.axes_of(output.tensor)]:
            sizes = [[a.size.root() for a in dim] for dim in leaves]
            labels = self.out_labels(sizes)
            output = self.emit(sizes, labels, [(sp.Integer(1), [self.operand(output, labels)])],
                               "output")
            leaves = self.leaf_dims(output)
        names = self._size_names()
        rename = {_symbol(size): sp.Symbol(name, positive=True, integer=True)
                  for size, name in names.items()}

        def named(size: Size) -> str:
            return names[size.root()]

        def shape(dims: list[list[Axis]]) -> tuple[tuple[str, ...], ...]:
            return tuple(tuple(named(a.size) for a in dim) for dim in dims)

        def item(name: str, skip_batch: bool = True) -> Input:
            role, value = self.inputs[name]
            dims = self.leaf_dims(value)
            batched = any(self.is_batch(a) for dim in dims for a in dim)
            if batched:
                dims = [dim for dim in dims if not any(self.is_batch(a) for a in dim)]
            return Input(name, tuple(named(a.size) for a in self.axes_of(name)),
                         shape(dims), batched, self.params.get(name, ""))

        self._pruned(output.tensor)
        read = {name for op in self.ops for name in
                ([t for _, operands in op.get("terms", ()) for t, _ in operands]
                 + ([op["source"][0]] if "source" in op else []))}
        inputs = [n for n, (role, _) in self.inputs.items() if n in read or role == "input"]
        kept = [n for n in inputs if self.inputs[n][0] != "constant"]  # X, parameters
        tensor = {n: n for n in kept}
        tensor.update(_canonical_names(
            [n for n in inputs if n not in tensor] + [op["out"] for op in self.ops],
            taken=set(kept)))
        ops = []
        for op in self.ops:
            axes = tuple((label, named(size)) for label, size in op["axes"])
            common = dict(kind=op["kind"], out=tensor[op["out"]], labels=tuple(op["labels"]),
                          axes=axes, path=op.get("path", ""), what=op.get("what", ""))
            if op["kind"] == "einsum":
                terms = tuple(Term(sp.sympify(coeff).xreplace(rename),
                                   tuple(Operand(tensor[t], tuple(ls)) for t, ls in operands))
                              for coeff, operands in op["terms"])
                ops.append(Op(**common, terms=terms))
            else:
                source, labels = op["source"]
                ops.append(Op(**common, fn=op.get("fn"),
                              source=Operand(tensor[source], tuple(labels))))

        def renamed(item_: Input) -> Input:
            return Input(tensor[item_.name], item_.axes, item_.shape, item_.batched,
                         item_.source)

        X = item("X")
        params = tuple(renamed(item(n)) for n in inputs if self.inputs[n][0] == "param")
        constants = tuple(renamed(item(n)) for n in inputs if self.inputs[n][0] == "constant")
        out = Input(tensor[output.tensor],
                    tuple(named(a.size) for a in self.axes_of(output.tensor)),
                    shape(leaves[:at] + leaves[at + 1:]), True)
        bound = {name for dim in X.shape for name in dim
                 if not isinstance(self._extent_named(name, names), int)}
        # a size bound at call time but not by X's shape (``L + 1`` after a concatenation) is
        # bound by the shape of a constant that has it
        sizes = tuple((name, None if name in bound or not isinstance(
            self._extent_named(name, names), int) else self._extent_named(name, names))
                      for name in sorted(set(names.values())))
        guards = tuple((tensor[t], tensor[s_], message) for t, s_, message in self.guards)
        program = Program(name="", title=self.title, sizes=sizes, X=X, params=params,
                          constants=constants, ops=tuple(ops), output=out, loss=self.loss,
                          guards=guards)
        recipes = []
        for constant in self.constants.values():
            if constant.name not in read:
                continue
            details = constant.details
            if constant.kind != "node":
                own, extents = details
                details = (own, tuple(tuple(named(s) for s in dim) for dim in extents))
            recipes.append(Constant(tensor[constant.name], constant.kind, constant.node,
                                    constant.transform, constant.batch_dim, details))
        symbols = {name: size.extent for size, name in names.items()
                   if not isinstance(size.extent, int)}
        return Reading(program, recipes, {tensor[n]: source for n, source in
                                          self.params.items() if n in read}, symbols, at,
                       self.vocabulary, self.padding, self.narrowing)

    def _pruned(self, output: str) -> None:
        """Drop the operations the output does not depend on (the queries and keys of an
        attention over one key, whose weight is 1)."""
        needed = {output} | {t for t, s_, _ in self.guards} | {s_ for _, s_, _ in self.guards}
        kept = []
        for op in reversed(self.ops):
            if op["out"] in needed:
                kept.append(op)
                needed.update(t for _, operands in op.get("terms", ()) for t, _ in operands)
                if "source" in op:
                    needed.add(op["source"][0])
        self.ops = kept[::-1]

    @staticmethod
    def _extent_named(name: str, names: dict[Size, str]) -> int | sp.Expr:
        return next(size.extent for size, n in names.items() if n == name)

    def _size_names(self) -> dict[Size, str]:
        """A name for every size class the program uses: ``L`` for the sequence, ``d`` for
        the input's width, the attention's ``h``, ``d_k``, ``d_v`` (``g``, ``r`` with grouped
        queries), and ``n<extent>`` for the others."""
        used: dict[Size, None] = {}
        for name, (_, value) in self.inputs.items():
            for axis in self.axes_of(name):
                used.setdefault(axis.size.root())
            for dim in self.leaf_dims(value):
                for axis in dim:
                    if not self.is_batch(axis):
                        used.setdefault(axis.size.root())
        for op in self.ops:
            for _, size in op["axes"]:
                used.setdefault(size.root())
        hints = {size.root(): hint for size, hint in self.hints.items()}
        X = self.leaf_dims(self.inputs["X"][1])
        for dim in X[1:]:
            for axis in dim:
                size = axis.size.root()
                if not isinstance(size.extent, int):
                    hints.setdefault(size, "L")
        if len(X) == 3 and len(X[2]) == 1:
            hints.setdefault(X[2][0].size.root(), "d")
        names: dict[Size, str] = {}
        taken: set[str] = set()
        for size in used:
            base = hints.get(size) or (f"n{size.extent}" if isinstance(size.extent, int)
                                       else "L")
            name, k = base, 1
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            taken.add(name)
            names[size] = name
        return names
