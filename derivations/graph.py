"""Graphs of named tensors: declarations and assignments in index form.

A :class:`Graph` holds the declared tensors (inputs, parameters, and every named node the
calculus creates) and an ordered list of :class:`Assign` statements ``name[free] = expr``.
Sublayers are written with a small operator syntax::

    i, j = g.index(L), g.index(d)
    mu = g.node("mu", (i,), (1 / d) * U[i, j])        # j is summed
    C = g.node("C", (i, j), U[i, j] - mu[i])

:meth:`Graph.bind` is where expressions stay small as they compose: a derived
expression with several data terms becomes a named node, with the Kronecker deltas that
all its terms share factored out (so a row-wise block-diagonal Jacobian is stored as one
``L×d×d`` block per row and the tie between rows is kept as a delta).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sympy as sp

from . import sizes
from .functions import ScalarFn
from .indexform import Apply, Delta, Expr, Index, IndexPool, Ref, Term


@dataclass(frozen=True)
class Guard:
    """A runtime precondition of a generated module: every entry of the node ``tensor`` must
    be strictly positive relative to the node ``scale`` (``tensor > tol · |scale|``), or the
    module stops with a ValueError on ``argument`` saying ``message``."""

    tensor: str
    scale: str
    argument: str
    message: str


@dataclass
class Tensor:
    """A declared named tensor. ``batched`` tensors carry one slice per sample."""

    name: str
    indices: tuple[Index, ...]
    batched: bool
    role: str = "node"  # "input", "param", "node", "constant", "target", "direction"

    @property
    def shape(self) -> tuple[sp.Symbol, ...]:
        return tuple(i.dim for i in self.indices)

    def __getitem__(self, indices: Index | tuple[Index, ...]) -> Expr:
        if isinstance(indices, Index):
            indices = (indices,)
        assert len(indices) == len(self.indices), f"{self.name} takes {len(self.indices)} indices"
        return Expr([Term(sp.Integer(1), (Ref(self.name, tuple(indices)),))])

    def apply(self, fn: ScalarFn, *indices: Index) -> Expr:
        """``fn`` applied elementwise to this tensor, indexed by ``indices``."""
        assert len(indices) == len(self.indices)
        return Expr([Term(sp.Integer(1), (Apply(fn, self.name, tuple(indices)),))])


@dataclass
class Assign:
    """``target[target.indices] = expr``; with ``mean_over_batch`` the per-sample
    results are averaged over the batch."""

    target: Tensor
    expr: Expr
    group: str
    mean_over_batch: bool = False
    reduction: str | None = None
    #: the number a constant table is made from (the rotary base)
    base: float | None = None
    #: the rotary table's scaling: (kind, factor, original length, low, high, beta fast,
    #: beta slow, amplitude), see :func:`.attention.rotary_scaling`
    scaling: tuple | None = None
    #: the relative-position buckets' (max distance, bidirectional)
    relative: tuple | None = None
    sublayer: str = ""  # the part of the architecture it belongs to (for documents)
    #: closed-form local derivative rules (a primitive such as the row softmax); the
    #: calculus uses them instead of the product rule on ``expr``
    rule: object | None = None
    #: an intermediate of a primitive's forward value: its derivatives are the rule's
    internal: bool = False

    @property
    def differentiable(self) -> bool:
        """False for constants (a row maximum, a causal mask, a rotary table, row
        weights) and for the intermediates of a primitive: no derivative is taken of them."""
        return self.reduction is None and not self.internal


def delta(a: Index, b: Index) -> Expr:
    return Expr([Term(sp.Integer(1), (Delta(a, b),))])


class Graph:
    """Declarations and assignments, with the index pool of one derivation."""

    def __init__(self) -> None:
        self.pool = IndexPool()
        self.tensors: dict[str, Tensor] = {}
        self.assigns: list[Assign] = []
        self.current_group = "forward"
        self.current_sublayer = ""

    @contextmanager
    def group(self, name: str) -> Iterator[None]:
        """Assignments made inside belong to the group ``name`` (one generated function)."""
        previous, self.current_group = self.current_group, name
        try:
            yield
        finally:
            self.current_group = previous

    @contextmanager
    def sublayer(self, name: str) -> Iterator[None]:
        """Assignments made inside belong to the sublayer ``name`` (a document section)."""
        previous, self.current_sublayer = self.current_sublayer, name
        try:
            yield
        finally:
            self.current_sublayer = previous

    def _append(self, tensor: Tensor, expr: Expr, **options) -> None:
        self.assigns.append(Assign(tensor, expr, self.current_group,
                                   sublayer=self.current_sublayer, **options))

    def in_group(self, name: str) -> list[Assign]:
        return [a for a in self.assigns if a.group == name]

    # -- declaring ---------------------------------------------------------------
    def index(self, dim: sp.Symbol, hint: str = "i") -> Index:
        return self.pool.fresh(dim, hint)

    def declare(self, name: str, indices: tuple[Index, ...], batched: bool,
                role: str = "node") -> Tensor:
        assert name not in self.tensors, f"{name} declared twice"
        tensor = Tensor(name, tuple(indices), batched, role)
        self.tensors[name] = tensor
        return tensor

    def input(self, name: str, dims: tuple[sp.Symbol, ...], role: str = "input",
              batched: bool = True) -> Tensor:
        return self.declare(name, tuple(self.index(d, "a") for d in dims), batched, role)

    def node(self, name: str, indices: tuple[Index, ...], expr: Expr, rule: object = None,
             internal: bool = False) -> Tensor:
        """Declare ``name[indices] = expr`` and append it to the assignments; ``rule`` gives
        its derivatives in closed form, ``internal`` marks an intermediate of a rule's node."""
        expr = expr.with_free(tuple(indices))
        tensor = self.declare(name, tuple(indices), self.is_batched(expr))
        self._append(tensor, expr, rule=rule, internal=internal)
        return tensor

    def row_max(self, name: str, source: Tensor) -> Tensor:
        """A constant ``name[i] = max_j source[i, j]`` (its derivatives are not taken: it
        only shifts a softmax argument, which leaves the softmax unchanged)."""
        indices = source.indices[:-1]
        tensor = self.declare(name, indices, source.batched, role="constant")
        expr = source[source.indices].with_free(source.indices)
        self._append(tensor, expr, reduction="max")
        return tensor

    def causal_bias(self, name: str, dim: sp.Symbol) -> Tensor:
        """A constant ``name[i, j]``: 0 where ``j <= i``, ``-inf`` where ``j > i``."""
        tensor = self.declare(name, (self.index(dim, "i"), self.index(dim, "j")), False,
                              role="constant")
        self._append(tensor, Expr([], tensor.indices), reduction="causal")
        return tensor

    def rotary(self, name: str, length: sp.Symbol, chunks: sp.Symbol, half: sp.Symbol,
               base: float, scaling: tuple) -> Tensor:
        """A constant ``name[i, s, t, m]`` (``length × chunks × chunks × half``): at position
        ``i``, over ``s, t < 2``, the rotation ``a [[cos φ, -sin φ], [sin φ, cos φ]]`` by the
        angle ``φ = i · ω_m`` of the pair ``(x_m, x_{half+m})`` of a head's entries (the
        rotate-half convention), ``ω_m = base^(-m/half)`` as ``scaling`` changes it (and the
        amplitude ``a``, 1 but for YaRN); the identity over the other chunks of ``half``
        entries (partial rotary: they do not turn)."""
        indices = (self.index(length, "i"), self.index(chunks, "s"),
                   self.index(chunks, "t"), self.index(half, "m"))
        tensor = self.declare(name, indices, False, role="constant")
        self._append(tensor, Expr([], indices), reduction="rotary", base=base, scaling=scaling)
        return tensor

    def relative_buckets(self, name: str, length: sp.Symbol, max_distance: int,
                         bidirectional: bool) -> Tensor:
        """A constant ``name[i, j, u]`` (``length × length × n_u``): 1 where ``u`` is the bucket
        of the offset ``j - i`` (T5's: the nearest ``n_u/2`` offsets, or ``n_u/4`` each way when
        ``bidirectional``, exactly, farther ones in logarithmic bins up to ``max_distance``),
        0 elsewhere."""
        indices = (self.index(length, "i"), self.index(length, "j"), self.index(sizes.n_u, "u"))
        tensor = self.declare(name, indices, False, role="constant")
        self._append(tensor, Expr([], indices), reduction="relative",
                     relative=(max_distance, bidirectional))
        return tensor

    def row_weights(self, name: str, length: sp.Symbol, kind: str) -> Tensor:
        """A constant ``name[o, i]`` (``1 × length``) of weights over ``length`` rows:
        ``1/length`` each for ``kind = "mean"``, ``δ_{i0}`` for ``"first"`` (the first row
        alone), ``1 - δ_{i0}`` for ``"rest"`` (every row but the first)."""
        indices = (self.index(sizes.n_1, "o"), self.index(length, "i"))
        tensor = self.declare(name, indices, False, role="constant")
        self._append(tensor, Expr([], indices), reduction=f"rows_{kind}")
        return tensor

    def output(self, name: str, expr: Expr, mean_over_batch: bool = False) -> Tensor:
        """Declare ``name`` as a dense per-sample result (deltas written as index
        broadcasts), or its average over the batch when ``mean_over_batch``."""
        assert expr.free is not None
        tensor = self.declare(name, expr.free, not mean_over_batch, role="output")
        self._append(tensor, expr, mean_over_batch=mean_over_batch)
        return tensor

    # -- queries -----------------------------------------------------------------
    def is_batched(self, expr: Expr) -> bool:
        return any(self.tensors[n].batched for n in expr.names())

    def term_is_batched(self, term: Term) -> bool:
        return any(self.tensors[f.name].batched for f in term.data_factors)

    # -- keeping expressions small -----------------------------------------------
    @staticmethod
    def _cheap(expr: Expr) -> bool:
        """Pure deltas and constants, or one product of at most three factors that sums
        over nothing (a contraction is worth naming: it is computed once and shared)."""
        data = [t.data_factors for t in expr.terms]
        if all(not d for d in data):
            return True
        if len(expr.terms) != 1 or len(data[0]) > 3:
            return False
        return set(expr.terms[0].indices()) <= set(expr.free)

    def bind(self, name: str, expr: Expr, force: bool = False) -> Expr:
        """``expr`` itself when it is cheap to carry inline (:meth:`_cheap`); otherwise a
        reference to a new named node ``name`` holding it, times what all its terms share:
        deltas (so a row-wise Jacobian is stored one block per row) and factors over free
        indices only (so ``Y[i,p] K[i,j,q]`` keeps its Kronecker structure and is never
        stored as an ``L×d×d×d_ff`` array)."""
        assert expr.free is not None
        if expr.is_zero:
            return expr
        if not force and self._cheap(expr):
            return expr
        common = set.intersection(*({frozenset(d.indices) for d in t.deltas}
                                    for t in expr.terms))
        order = {index: n for n, index in enumerate(expr.free)}
        parent = {index: index for index in expr.free}

        def find(index: Index) -> Index:
            while parent[index] != index:
                index = parent[index]
            return index

        for pair in sorted(common, key=lambda p: sorted(order[i] for i in p)):
            a, b = sorted(pair, key=order.__getitem__)
            ra, rb = find(a), find(b)
            if ra != rb:
                first, second = sorted((ra, rb), key=order.__getitem__)
                parent[second] = first
        mapping = {index: find(index) for index in expr.free}
        reduced = tuple(i for i in expr.free if mapping[i] == i)
        terms = []
        for term in expr.terms:
            kept = tuple(f for f in term.factors
                         if not (isinstance(f, Delta) and frozenset(f.indices) in common))
            terms.append(Term(term.coeff, kept).renamed(mapping))
        body = Expr(terms, reduced).simplified()
        ties = tuple(Delta(mapping[i], i) for i in expr.free if mapping[i] != i)
        whole = body
        shared, body = self._shared_factors(body)
        if force and any(isinstance(f, Apply) and set(f.indices) == set(reduced)
                         for f in shared):
            # a forced node whose terms share an elementwise function over all its entries
            # (an activation's derivative) is stored whole: that function is computed once
            shared, body = (), whole
        elif shared and self._cheap(body):
            return Expr([Term(t.coeff, shared + t.factors + ties) for t in body.terms],
                        expr.free)
        tensor = self.declare(name, body.free, self.is_batched(body))
        self._append(tensor, body)
        return Expr([Term(sp.Integer(1), shared + (Ref(name, body.free),) + ties)], expr.free)

    @staticmethod
    def _shared_factors(body: Expr) -> tuple[tuple, Expr]:
        """The data factors over free indices that every term of ``body`` has, and
        ``body`` without them, over the free indices it still carries (a named tensor
        never stores a broadcast axis)."""
        free = set(body.free)
        shared = []
        remaining = [list(t.factors) for t in body.terms]
        for factor in body.terms[0].data_factors:
            if set(factor.indices) <= free and all(factor in r for r in remaining):
                shared.append(factor)
                for r in remaining:
                    r.remove(factor)
        terms = [Term(t.coeff, tuple(r)) for t, r in zip(body.terms, remaining)]
        carried = {i for t in terms for i in t.indices()}  # the others are broadcast
        return tuple(shared), Expr(terms, tuple(i for i in body.free if i in carried))
