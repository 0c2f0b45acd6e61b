"""What reading a traced module produces and works with: the errors it raises, a traced
tensor as the program holds it (:class:`Value`), a graph to read (:class:`Source`), a constant
and how it is made at call time (:class:`Constant`), the result (:class:`Reading`), and the
numbers of a trace as SymPy holds them."""

from __future__ import annotations

import fractions
import math
import re
from dataclasses import dataclass, field

import sympy as sp
import torch

from ..derivations.functions import x
from ..derivations.program import Program
from .axes import Axis, Size, extent_of


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
    ``1/3``, the square root of one: ``1/sqrt(3)`` to the last bit of its float, or of one
    over pi: GELU's ``sqrt(2/pi)``), else the float it is (``0.044715``, ``1e-12``,
    ``finfo.min``). Never an exact rational of a float's binary value (a 300-digit integer
    for ``finfo.max``)."""
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
        over_pi = fractions.Fraction(value * value * math.pi).limit_denominator(100)
        root = sp.sqrt(sp.Rational(over_pi.numerator, over_pi.denominator) / sp.pi)
        root = root if value > 0 else -root
        if abs(float(root) - value) <= math.ulp(value):  # GELU's sqrt(2/pi)
            return root
    return sp.Float(value, precision=53)  # printed as a float's shortest repr


def _symbol(size: Size) -> sp.Symbol:
    """A stand-in for the size symbol of ``size``'s class (named when the reading ends)."""
    return sp.Symbol(f"_size{size.root().order}", positive=True, integer=True)


def _extent(value: object) -> int | sp.Expr:
    """A dimension's extent: an int, or the SymPy expression of a symbolic size."""
    if isinstance(value, torch.SymInt):
        return extent_of(value.node.expr)
    return int(value)

