"""The node loop: a traced module's graph lowered into a
:class:`~curvgap.derivations.program.Program`, each operation by its rule (:mod:`.rules`),
written with the einsum builder (:mod:`.builder`).

The graph comes from ``torch.export`` (:mod:`.trace`). Every node that depends on the input
``X`` or on a parameter is *differentiable* and becomes program operations: linear maps,
products, sums, reductions and reshapes become einsums over split axes (:mod:`.axes`),
elementwise chains are fused into one SymPy function of one tensor (an activation, a shifted
reciprocal square root), ``softmax`` is the engine's primitive, and ``layer_norm`` and
``scaled_dot_product_attention`` are written out in those terms. Every other node (masks,
position ids, rotary tables, shapes) is a *constant*: computed by the module's own code at
call time (:mod:`.trace`), passed to the generated code as an input. Anything else is refused
with the operation, the submodule's path and what is missing.

The graph is read twice (or until a pass changes no size class): a reshape met late may
split an axis met early, and the second pass reads every tensor with its final factors.
"""

from __future__ import annotations

import operator
import re

import sympy as sp
import torch

from ..derivations.program import Input, Op, Operand, Program, Term
from .axes import Axis, Changes, ShapeError, Size
from .builder import Builder
from .records import (
    TOKENS,
    Constant,
    Reading,
    Source,
    UnsupportedOperation,
    Value,
    _symbol,
)
from .rules import RULES


def program_of(source: Source, title: str, loss: str) -> Reading:
    """The program of ``source``'s graph (see the module docstring): passes until one
    changes no size class."""
    sizes: dict[tuple, Size] = {}
    hints: dict[Size, str] = {}
    changes = Changes()
    for _ in range(5):
        before = changes.count
        reading = Reader(source, title, loss, sizes, hints, changes).run()
        if changes.count == before:
            return reading
    raise UnsupportedOperation("the module: its reshapes did not settle into common "
                               "factors")


class Reader(Builder):
    """One pass over a graph: each node lowered by its rule (:mod:`.rules`), the program
    written out."""

    def run(self) -> Reading:
        """Lower every node (its rule, a constant, an input), then write the program."""
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

    def _operation(self, node: torch.fx.Node) -> object:
        target = node.target
        if target is operator.getitem:
            return self.values[node.args[0].name][node.args[1]]
        lower = RULES.get(target) or RULES.get(getattr(target, "_overloadpacket", None))
        if lower is None:
            raise self.refuse("an operation it can derive (this one is not in its vocabulary: "
                              "linear maps, products, sums, reshapes, elementwise functions, "
                              "softmax, layer_norm, rms_norm, scaled_dot_product_attention)")
        return lower(self, node, *node.args, **node.kwargs)

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
                ([t for _, operands in op.terms for t, _ in operands]
                 + ([op.source[0]] if op.source is not None else []))}
        inputs = [n for n, (role, _) in self.inputs.items() if n in read or role == "input"]
        kept = [n for n in inputs if self.inputs[n][0] != "constant"]  # X, parameters
        tensor = {n: n for n in kept}
        tensor.update(_canonical_names(
            [n for n in inputs if n not in tensor] + [op.out for op in self.ops],
            taken=set(kept)))
        ops = []
        for op in self.ops:
            axes = tuple((label, named(size)) for label, size in op.axes)
            common = dict(kind=op.kind, out=tensor[op.out], labels=tuple(op.labels),
                          axes=axes, path=op.path, what=op.what)
            if op.kind == "einsum":
                terms = tuple(Term(sp.sympify(coeff).xreplace(rename),
                                   tuple(Operand(tensor[t], tuple(ls)) for t, ls in operands))
                              for coeff, operands in op.terms)
                ops.append(Op(**common, terms=terms))
            else:
                source, labels = op.source
                ops.append(Op(**common, fn=op.fn,
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
                          guards=guards, tokens=self.vocabulary is not None)
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
            if op.out in needed:
                kept.append(op)
                needed.update(t for _, operands in op.terms for t, _ in operands)
                if op.source is not None:
                    needed.add(op.source[0])
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
            for _, size in op.axes:
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
