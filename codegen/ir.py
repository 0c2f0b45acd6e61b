"""The statements a group function is lowered to; each backend's printer prints them
with one ``_print_<Statement>`` method per class (as SymPy's printers do for nodes)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..derivations.graph import Guard  # a statement as it is: checked after its node

__all__ = ["Accumulate", "Assign", "CausalBias", "Combine", "Contract", "Elementwise", "Free",
           "Guard", "Part", "RowWeights", "RelativeBuckets", "Rotary", "RowMax", "Zeros"]


@dataclass(frozen=True)
class Elementwise:
    """``result = fn(argument)``, ``fn`` a SymPy expression in ``variable``."""

    result: str
    fn: sp.Expr
    variable: sp.Symbol
    argument: str


@dataclass(frozen=True)
class Contract:
    """``result = einsum(spec, *operands)`` (two operands at most: a computed order);
    ``row_major``: the result is laid out row-major (a node: arrays computed from it
    follow its layout, and reshapes of a transposed layout copy); ``into``: a matrix
    product writes it straight into the caller's array for it, when the call has one (a
    result the caller places in a larger array, such as a gradient in a flat vector)."""

    result: str
    spec: str
    operands: tuple[str, ...]
    row_major: bool = False
    into: bool = False


@dataclass(frozen=True)
class Part:
    """One summand of :class:`Combine`: ``coeff * value``, its axes first reordered by
    ``permute`` (an einsum spec such as ``"abc->acb"``) when given; ``broadcast`` marks
    with None the axes that ``value`` lacks (None: it has them all)."""

    coeff: sp.Expr
    value: str
    permute: str | None = None
    broadcast: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class Combine:
    """``result = Σ parts`` (a fresh array; the first part has every axis), row-major
    when ``row_major``."""

    result: str
    parts: tuple[Part, ...]
    row_major: bool = False


@dataclass(frozen=True)
class Free:
    """``del names``: temporaries past their last use (keeps peak memory down)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Zeros:
    """``result = zeros(shape)`` in the dtype and device of the input."""

    result: str
    shape: tuple[sp.Expr, ...]


@dataclass(frozen=True)
class Assign:
    """``result = coeff * value`` (``value`` None: the constant ``coeff``), row-major
    when ``row_major``."""

    result: str
    value: str | None
    coeff: sp.Expr
    row_major: bool = False


@dataclass(frozen=True)
class Scale:
    """``target *= coeff`` in place (a fresh product scaled without a second array)."""

    target: str
    coeff: sp.Expr


@dataclass(frozen=True)
class Accumulate:
    """``view(target) += coeff * value[broadcast]``; ``tie`` is an einsum spec such as
    ``"bijj->bij"`` that selects the entries where tied indices are equal (None: all);
    ``broadcast`` marks with None the axes that ``value`` lacks."""

    target: str
    tie: str | None
    value: str | None
    coeff: sp.Expr
    broadcast: tuple[bool, ...] | None


@dataclass(frozen=True)
class RowMax:
    """``result = max of source over its last axis`` (a constant softmax shift)."""

    result: str
    source: str


@dataclass(frozen=True)
class Rotary:
    """``result = (length × chunks × chunks × half)``: the rotary rotations
    ``a [[cos φ, -sin φ], [sin φ, cos φ]]`` over the first two chunks, ``φ = i · ω_m`` at
    position ``i`` (``ω_m = base^(-m/half)``, changed by ``scaling``), the identity over the
    others."""

    result: str
    length: sp.Expr
    chunks: sp.Expr
    half: sp.Expr
    base: float
    scaling: tuple


@dataclass(frozen=True)
class RelativeBuckets:
    """``result = (length × length × buckets)``: 1 where the last index is the bucket of the
    offset ``j - i`` (T5's buckets up to ``max_distance``), 0 elsewhere."""

    result: str
    length: sp.Expr
    buckets: sp.Expr
    max_distance: int
    bidirectional: bool


@dataclass(frozen=True)
class RowWeights:
    """``result = (1 × length)``: weights over the rows, ``1/length`` each for
    ``kind = "mean"``, ``[1, 0, …, 0]`` for ``"first"``, ``[0, 1, …, 1]`` for ``"rest"``."""

    result: str
    length: sp.Expr
    kind: str


@dataclass(frozen=True)
class CausalBias:
    """``result = (size × size)`` with 0 on and below the diagonal, ``-inf`` above."""

    result: str
    size: sp.Expr
