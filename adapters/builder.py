"""The einsum builder a reading pass writes its program with: size classes and axes
(:mod:`.axes`), program tensors and their names, constants declared as inputs, tables of the
program's own, elementwise functions held in a tensor (a ``map``), and einsums over labelled
axes (:meth:`Builder.emit`, :meth:`Builder.combine` broadcasting as torch does). The rules
(:mod:`.rules`) lower each operation through it; the node loop is :mod:`.reader`."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp
import torch

from ..derivations.functions import x
from .axes import Axis, Changes, ShapeError, Size, align, extent_of
from .nodes import _path, ancestors, differentiable, refusal
from .records import (
    EMPTY,
    TOKENS,
    Constant,
    Source,
    UnsupportedOperation,
    Value,
    _extent,
    _identifier,
)


@dataclass
class Pending:
    """An operation as a pass writes it, its sizes still classes: ``einsum`` (``Σ coeff Π
    operands`` over ``terms``), ``map`` (the elementwise ``fn`` of ``source``) or ``softmax``
    (of ``source`` over its last label); written at ``labels``, each label's class in
    ``axes``; ``what`` operation of which submodule (``path``) made it."""

    kind: str
    out: str
    labels: list[str]
    axes: list[tuple[str, Size]]
    what: str = ""
    path: str = ""
    terms: list = field(default_factory=list)
    fn: sp.Expr | None = None
    source: tuple[str, list[str]] | None = None


class Builder:
    """The state of one pass over ``source`` and the operations it writes. ``sizes``,
    ``hints`` and ``changes`` outlive the pass: a later pass reads every tensor with the
    factors an earlier one found."""

    def __init__(self, source: Source, title: str, loss: str, sizes: dict[tuple, Size],
                 hints: dict[Size, str], changes: Changes) -> None:
        self.source, self.graph, self.root = source, source.graph, source.root
        self.title, self.loss = title, loss
        self.param_of = dict(source.params)
        self._sizes, self.hints, self.changes = sizes, hints, changes
        self.batch: Size | None = None
        self.values: dict[str, object] = {}
        self.ops: list[Pending] = []
        self.inputs: dict[str, tuple[str, Value]] = {}
        self._tensor_axes: dict[str, list[Axis]] = {}
        self.constants: dict[str, Constant] = {}
        self.declared: dict[tuple, Value] = {}
        self.mapped: dict[tuple, tuple] = {}
        # the input's name and those the derivation gives the target and the loss's nodes
        self.names: set[str] = {"X", "Z", "T", "D", "ell"}
        self.params: dict[str, str] = {}
        self.labels = 0
        self.guards: list[tuple[str, str, str]] = []
        self.node: torch.fx.Node | None = None
        self.vocabulary: int | None = None
        self.padding: int | None = None
        self.narrowing = ""
        # what the output is computed from (a second output's pooler is not)
        self.differentiable = differentiable(self.graph, {source.X, *self.param_of}) & \
            ancestors(source.output)

    def computed(self, value: Value, what: str) -> Value:
        """``value``, refused where it is not a tensor the program computes (token ids)."""
        if value.constant is not None:
            raise self.refuse(f"{what} of a tensor computed from X or the parameters "
                              "(not of token ids)")
        return value

    def size(self, key: tuple, extent: int | sp.Expr) -> Size:
        """The size class of ``key`` (the same object in every pass); every dimension of one
        symbolic extent shares one class."""
        extent = extent_of(extent)
        if not isinstance(extent, int):
            key = ("symbol", extent)
        if key not in self._sizes:
            self._sizes[key] = Size(extent, self.changes)
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
        if base.startswith("ce_"):  # the cross-entropy's nodes are ce_*
            base = f"p_{base}"
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

    def refuse(self, missing: str) -> UnsupportedOperation:
        """The error for the current node: its operation, its submodule, what is missing."""
        return refusal(self.node, missing, self.root)

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
            self.ops.append(Pending("map", name, labels,
                                    list(zip(labels, [a.size.root() for a in source])),
                                    what or self.what(), path or self.where(),
                                    fn=value.expr, source=(value.tensor, labels)))
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
        self.ops.append(Pending("einsum", name, out_labels, list(axes_of.items()),
                                self.what(), self.where(), terms=terms))
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

    def with_dims(self, value: Value, dims: list[list[Axis]]) -> Value:
        return Value(dims, value.tensor, value.axes, value.expr, value.constant, value.transform)

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
