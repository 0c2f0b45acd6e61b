"""Programs: a computation read from a real module (:mod:`curvgap.adapters.trace`), as data the
engine derives like a config.

A :class:`Program` is the per-sample forward pass of a module in three kinds of operation on
named tensors over named *axes* (sizes ``sizes``):

* ``einsum``   ``out[o] = Σ_t c_t Π_k a_tk[·]``: linear maps, products, sums, broadcasts,
  reductions, transposes and the selections of slices and concatenations;
* ``map``      ``out[o] = f(a[o])`` for a SymPy expression ``f`` of :data:`~.functions.x`
  (every elementwise chain of the module fused into one function: an activation, a shifted
  reciprocal square root);
* ``softmax``  ``out = softmax(a)`` over the last axis: the engine's stable primitive.

Inputs are ``X`` (per sample), the parameters (each in its module's own layout: the axes of
a parameter are its dimensions split into factors, row-major, so reading one is a reshape),
and *constants* that the caller computes for each call and passes with the parameters
(masks, rotary tables, selections). The output is ``Z``, its axes in the module's row-major
order. Nothing in a program is a derivative: those are the engine's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sympy as sp

from .functions import ScalarFn, recognised, x
from .graph import Graph, Guard, Tensor
from .indexform import Expr, Index
from .softmax import softmax_rows


@dataclass(frozen=True)
class Operand:
    """The tensor ``name`` read at the labels ``labels`` (one per axis of the tensor)."""

    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Term:
    """``coeff`` times the product of ``operands`` (labels not in the output are summed)."""

    coeff: sp.Expr
    operands: tuple[Operand, ...]


@dataclass(frozen=True)
class Op:
    """``out[labels] = ...``: an ``einsum`` of ``terms``, a ``map`` of ``fn`` over ``source``
    (at ``labels``), or a ``softmax`` of ``source`` over its last label. ``axes`` gives each
    label's axis (its size); ``path`` is the submodule the operation comes from and
    ``what`` names it (``linear``, ``layer_norm``, ``scaled_dot_product_attention``)."""

    kind: str
    out: str
    labels: tuple[str, ...]
    axes: tuple[tuple[str, str], ...]
    terms: tuple[Term, ...] = ()
    fn: sp.Expr | None = None
    source: Operand | None = None
    path: str = ""
    what: str = ""


@dataclass(frozen=True)
class Input:
    """A tensor the generated code reads: ``X``, a parameter or a constant. ``axes`` are its
    engine axes (row-major); ``shape`` the dimensions a caller passes, each a tuple of the
    axes it holds (row-major); ``source`` the module's name for it."""

    name: str
    axes: tuple[str, ...]
    shape: tuple[tuple[str, ...], ...]
    batched: bool
    source: str = ""


@dataclass(frozen=True)
class Program:
    """A module's per-sample forward pass (see the module docstring) and its loss."""

    name: str
    title: str
    sizes: tuple[tuple[str, int | None], ...]
    X: Input
    params: tuple[Input, ...]
    constants: tuple[Input, ...]
    ops: tuple[Op, ...]
    #: the output: the node ``output.name``, its axes and the module's dimensions of them
    output: Input
    loss: str = "mse"
    #: ``(tensor, scale, message)``: every entry of ``tensor`` must be positive relative to
    #: ``scale`` (a normalisation with ``eps = 0``)
    guards: tuple[tuple[str, str, str], ...] = ()
    #: what is derived: ``"products"`` (loss, gradient, Hessian- and Gauss–Newton-vector
    #: products, the pieces chains compose), ``"blocks"`` (those and the Jacobians,
    #: loss-Hessian blocks, diagonals and Kronecker factors) or ``"all"`` (those and the
    #: output Hessians ``∂²Z/∂V∂W``, which a document states)
    scope: str = "blocks"
    #: ``X`` holds the one-hot rows of token ids: data, not a variable (autograd takes no
    #: derivative in integer ids either), its products printed as gathers and scatters of rows
    tokens: bool = False

    @property
    def fingerprint(self) -> str:
        """A digest equal for equal programs whatever their names (SymPy expressions by
        ``srepr``)."""
        text = repr(_canonical(self))
        return hashlib.sha256(text.encode()).hexdigest()

    def dims(self) -> dict[str, sp.Symbol]:
        """Each axis as a size symbol."""
        return {name: sp.Symbol(name, positive=True, integer=True) for name, _ in self.sizes}

    def constant_dims(self) -> dict[str, int]:
        """The sizes the module fixes (all but those bound from ``X``)."""
        return {name: size for name, size in self.sizes if size is not None}


def _canonical(value: object) -> object:
    if isinstance(value, sp.Basic):
        return sp.srepr(value)
    if isinstance(value, Program):
        return tuple((f, _canonical(getattr(value, f))) for f in value.__dataclass_fields__
                     if f != "name")
    if hasattr(value, "__dataclass_fields__"):
        return tuple((f, _canonical(getattr(value, f))) for f in value.__dataclass_fields__)
    if isinstance(value, tuple | list):
        return tuple(_canonical(v) for v in value)
    return value


def external_shapes(program: Program) -> dict[str, tuple[str, ...]]:
    """The shapes callers pass (dimension names, ``"h*d_k"`` for a dimension holding two
    axes, ``"1"`` for a dimension of size one) where they differ from the engine's axes:
    for ``X``, the parameters, the constants and the output ``Z``."""
    shapes = {}
    for item in (program.X, *program.params, *program.constants, program.output):
        external = tuple("*".join(dim) or "1" for dim in item.shape)
        if external != item.axes:
            shapes["Z" if item is program.output else item.name] = external
    return shapes


def build(g: Graph, program: Program) -> tuple[Tensor, Tensor, list[Tensor], list[Guard]]:
    """The program's nodes in ``g``: the input ``X``, the output, the parameters in order
    (constants declared as per-call inputs), and the runtime guards."""
    dims = program.dims()
    tensors: dict[str, Tensor] = {}

    def declare(item: Input, role: str) -> Tensor:
        tensor = g.input(item.name, tuple(dims[a] for a in item.axes), role=role,
                         batched=item.batched)
        tensors[item.name] = tensor
        return tensor

    X = declare(program.X, "input")
    params = [declare(p, "param") for p in program.params]
    for constant in program.constants:
        declare(constant, "constant")
    for op in program.ops:
        with g.sublayer(op.path or program.title):
            tensors[op.out] = _node(g, op, tensors, dims)
    guards = [Guard(tensor, scale, "X", message) for tensor, scale, message in program.guards]
    return X, tensors[program.output.name], params, guards


def _node(g: Graph, op: Op, tensors: dict[str, Tensor], dims: dict[str, sp.Symbol]) -> Tensor:
    """The node of one operation."""
    index: dict[str, Index] = {label: g.index(dims[axis], "i") for label, axis in op.axes}
    out = tuple(index[label] for label in op.labels)

    def read(operand: Operand) -> tuple[Tensor, tuple[Index, ...]]:
        return tensors[operand.name], tuple(index[label] for label in operand.labels)

    if op.kind == "einsum":
        expr = Expr()
        for term in op.terms:
            product = Expr.lift(term.coeff)
            for operand in term.operands:
                tensor, at = read(operand)
                product = product * tensor[at]
            expr = expr + product
        return g.node(op.out, out, expr)
    tensor, at = read(op.source)
    if op.kind == "map":
        label = recognised(op.fn) or op.what or "f"  # GELU written out is still GELU
        return g.node(op.out, out, tensor.apply(ScalarFn(label, op.fn), *at))
    if op.kind == "softmax":
        assert at == out, "a softmax reads its source at its own labels"
        return softmax_rows(g, tensor, name=op.out, prefix=f"{op.out}_")
    raise ValueError(f"op: expected an einsum, map or softmax, got {op.kind!r}")


def describe(program: Program) -> tuple[str, str]:
    """A title and the program as lines of equations (for docstrings)."""
    lines = [_line(op) for op in program.ops]
    lines.append(f"Z = {program.output.name}; loss: {program.loss} per sample, averaged over "
                 "the batch")
    return (f"{program.title}: exact Jacobians, Hessians and Hessian-vector products.",
            "\n".join(lines))


def _operand_text(operand: Operand) -> str:
    return f"{operand.name}[{', '.join(operand.labels)}]" if operand.labels else operand.name


def _line(op: Op) -> str:
    """One operation as text, with the submodule it comes from."""
    target = _operand_text(Operand(op.out, op.labels))
    if op.kind == "einsum":
        summed = sorted({label for term in op.terms for operand in term.operands
                         for label in operand.labels} - set(op.labels))
        terms = []
        for term in op.terms:
            factors = [_operand_text(o) for o in term.operands]
            coeff = ("" if term.coeff == 1 else "-" if term.coeff == -1 and factors
                     else f"{term.coeff}*" if factors else str(term.coeff))
            terms.append(coeff + " ".join(factors))
        body = " + ".join(terms).replace("+ -", "- ")
        if summed:
            body = f"sum_{{{', '.join(summed)}}} {body}"
    elif op.kind == "map":
        body = str(op.fn.subs(x, sp.Symbol(_operand_text(op.source))))
    else:
        body = f"softmax({_operand_text(op.source)}) over {op.labels[-1]}"
    where = f"  ({op.path}: {op.what})" if op.path or op.what else ""
    return f"{target} = {body}{where}"
