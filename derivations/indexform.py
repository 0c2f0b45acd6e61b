"""Index-form tensor algebra: the engine's expressions.

An :class:`Expr` is a sum of :class:`Term` objects over declared *free* indices. A term is
a SymPy coefficient times a product of factors; an index that appears among a term's
factors but not among the free indices is summed (Einstein convention), so every term is
one einsum. The factors are

* :class:`Ref`   ``name[i, j]``      a named tensor (input, parameter, node, tangent, adjoint),
* :class:`Apply` ``f(name)[i, j]``   an elementwise scalar function of a named tensor,
* :class:`Delta` ``δ[a, b]``         a Kronecker delta.

Deltas with a summed index are eliminated by substitution (:func:`simplify_term`); those
left tie two free indices and are lowered to index broadcasts, never to identity matrices.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import sympy as sp

from .functions import ScalarFn


@dataclass(frozen=True)
class Index:
    """A tensor index ranging over ``dim`` values (``dim`` a size symbol such as ``L``)."""

    name: str
    dim: sp.Symbol

    def __repr__(self) -> str:
        return self.name


class IndexPool:
    """Hands out fresh, deterministic index names for one derivation."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def fresh(self, dim: sp.Symbol, hint: str = "k") -> Index:
        return Index(f"{hint}{next(self._counter)}", dim)


@dataclass(frozen=True)
class Ref:
    """A named tensor indexed by ``indices``."""

    name: str
    indices: tuple[Index, ...]

    def renamed(self, mapping: dict[Index, Index]) -> Ref:
        return Ref(self.name, tuple(mapping.get(i, i) for i in self.indices))


@dataclass(frozen=True)
class Apply:
    """The elementwise function ``fn`` applied to the named tensor ``name``."""

    fn: ScalarFn
    name: str
    indices: tuple[Index, ...]

    def renamed(self, mapping: dict[Index, Index]) -> Apply:
        return Apply(self.fn, self.name, tuple(mapping.get(i, i) for i in self.indices))


@dataclass(frozen=True)
class Delta:
    """The Kronecker delta ``δ[a, b]``."""

    a: Index
    b: Index

    @property
    def indices(self) -> tuple[Index, ...]:
        return (self.a, self.b)

    def renamed(self, mapping: dict[Index, Index]) -> Delta:
        return Delta(mapping.get(self.a, self.a), mapping.get(self.b, self.b))


Factor = Ref | Apply | Delta


@dataclass(frozen=True)
class Term:
    """``coeff`` times the product of ``factors``."""

    coeff: sp.Expr
    factors: tuple[Factor, ...] = ()

    def indices(self) -> list[Index]:
        """Every index of the factors, in order of first appearance."""
        seen: dict[Index, None] = {}
        for factor in self.factors:
            for index in factor.indices:
                seen.setdefault(index, None)
        return list(seen)

    def renamed(self, mapping: dict[Index, Index]) -> Term:
        return Term(self.coeff, tuple(f.renamed(mapping) for f in self.factors))

    @property
    def data_factors(self) -> tuple[Ref | Apply, ...]:
        return tuple(f for f in self.factors if not isinstance(f, Delta))

    @property
    def deltas(self) -> tuple[Delta, ...]:
        return tuple(f for f in self.factors if isinstance(f, Delta))


@dataclass
class Expr:
    """A sum of terms. ``free`` is ``None`` while the expression is being built with
    operators, and set once it becomes a node's definition (:meth:`with_free`)."""

    terms: list[Term] = field(default_factory=list)
    free: tuple[Index, ...] | None = None

    # -- building with operators -------------------------------------------------
    @staticmethod
    def lift(value: Expr | int | float | sp.Expr) -> Expr:
        if isinstance(value, Expr):
            return value
        return Expr([Term(sp.sympify(value))])

    def __add__(self, other: Expr | int | float | sp.Expr) -> Expr:
        return Expr(self.terms + Expr.lift(other).terms)

    __radd__ = __add__

    def __neg__(self) -> Expr:
        return Expr([Term(-t.coeff, t.factors) for t in self.terms])

    def __sub__(self, other: Expr | int | float | sp.Expr) -> Expr:
        return self + (-Expr.lift(other))

    def __rsub__(self, other: Expr | int | float | sp.Expr) -> Expr:
        return Expr.lift(other) + (-self)

    def __mul__(self, other: Expr | int | float | sp.Expr) -> Expr:
        other = Expr.lift(other)
        return Expr([Term(a.coeff * b.coeff, a.factors + b.factors)
                     for a in self.terms for b in other.terms])

    __rmul__ = __mul__

    def with_free(self, free: tuple[Index, ...]) -> Expr:
        """This expression with ``free`` as its output indices, simplified."""
        return Expr(self.terms, tuple(free)).simplified()

    # -- queries -----------------------------------------------------------------
    @property
    def is_zero(self) -> bool:
        return not self.terms

    def names(self) -> set[str]:
        """Names of the tensors this expression reads."""
        return {f.name for t in self.terms for f in t.data_factors}

    def simplified(self) -> Expr:
        """Deltas eliminated, like terms merged, zero terms dropped."""
        assert self.free is not None
        merged: dict[tuple, sp.Expr] = {}
        canonical: dict[tuple, Term] = {}
        for term in self.terms:
            term = simplify_term(term, self.free)
            if term is None:
                continue
            key, canon = canonical_form(term, self.free)
            merged[key] = merged.get(key, sp.Integer(0)) + canon.coeff
            canonical.setdefault(key, canon)
        terms = []
        for key, coeff in merged.items():
            coeff = sp.cancel(coeff)
            if coeff != 0:
                terms.append(Term(coeff, canonical[key].factors))
        return Expr(terms, self.free)


def simplify_term(term: Term, free_order: tuple[Index, ...]) -> Term | None:
    """Eliminate every delta that has a summed index, and write each index tied to an
    earlier free index by a remaining delta as that earlier index in the other factors;
    ``None`` if the term is zero."""
    if term.coeff == 0:
        return None
    free = set(free_order)
    coeff, factors = term.coeff, list(term.factors)
    changed = True
    while changed:
        changed = False
        for k, factor in enumerate(factors):
            if not isinstance(factor, Delta):
                continue
            a, b = factor.a, factor.b
            rest = factors[:k] + factors[k + 1:]
            if a == b:
                if a not in free and not any(a in f.indices for f in rest):
                    coeff = coeff * a.dim
                factors = rest
            elif a not in free:
                factors = [f.renamed({a: b}) for f in rest]
            elif b not in free:
                factors = [f.renamed({b: a}) for f in rest]
            else:
                continue
            changed = True
            break
    position = {index: n for n, index in enumerate(free_order)}
    for delta_factor in [f for f in factors if isinstance(f, Delta)]:
        a, b = sorted(delta_factor.indices, key=position.__getitem__)
        factors = [f if f is delta_factor or isinstance(f, Delta) else f.renamed({b: a})
                   for f in factors]
    return Term(coeff, tuple(factors))


def _factor_key(factor: Factor, free_pos: dict[Index, int]) -> tuple:
    pattern = tuple(free_pos.get(i, -1) for i in factor.indices)
    if isinstance(factor, Delta):
        return (0, "", "", tuple(sorted(pattern)))
    if isinstance(factor, Ref):
        return (1, factor.name, "", pattern)
    return (2, factor.name, factor.fn.key, pattern)


def canonical_form(term: Term, free: tuple[Index, ...]) -> tuple[tuple, Term]:
    """A key equal for terms that differ only in the order of their factors and the names
    of summed indices, and the term rewritten in that canonical form. Factors are sorted
    by name and by where the free indices sit; ties (such as ``A[i,j] A[i,k]``) are broken
    by trying their orders (up to 24) and keeping the smallest key."""
    free_pos = {index: n for n, index in enumerate(free)}
    factors = sorted(term.factors, key=lambda f: _factor_key(f, free_pos))
    groups = [list(g) for _, g in itertools.groupby(factors, lambda f: _factor_key(f, free_pos))]
    orders = 1
    for group in groups:
        orders *= math.factorial(len(group))
    candidates = (itertools.product(*(itertools.permutations(g) for g in groups))
                  if orders <= 24 else [tuple(groups)])
    best = None
    for choice in candidates:
        key, canon = _relabel([f for group in choice for f in group], free_pos, term.coeff)
        if best is None or key < best[0]:
            best = (key, canon)
    return best


def _relabel(factors: list[Factor], free_pos: dict[Index, int],
             coeff: sp.Expr) -> tuple[tuple, Term]:
    mapping: dict[Index, Index] = {}
    for factor in factors:
        for index in factor.indices:
            if index not in free_pos and index not in mapping:
                mapping[index] = Index(f"_s{len(mapping)}", index.dim)
    renamed = []
    for factor in factors:
        factor = factor.renamed(mapping)
        if isinstance(factor, Delta):
            order = lambda i: (free_pos.get(i, len(free_pos)), i.name)  # noqa: E731
            a, b = sorted((factor.a, factor.b), key=order)
            factor = Delta(a, b)
        renamed.append(factor)
    key = tuple(_hashable(f) for f in renamed)
    return key, Term(coeff, tuple(renamed))


def _hashable(factor: Factor) -> tuple:
    names = tuple((i.name, str(i.dim)) for i in factor.indices)
    if isinstance(factor, Delta):
        return ("δ", names)
    if isinstance(factor, Ref):
        return ("ref", factor.name, names)
    return ("apply", factor.fn.key, factor.name, names)
