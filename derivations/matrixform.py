"""The paper's matrix notation for index-form expressions, where the structure allows it.

A derived tensor is read as a matrix in the paper's layout (:func:`layout`): its rows are
the node's indices followed by the first direction's, its columns the last direction's
(``vec_r`` numerator layout), so an entry ``M[(i, j), (p, q)]`` sits at row ``i·n_j + j``.
:func:`to_matrix` rewrites an expression term by term with three rules:

1. **Chains.** Factors connected through their indices, each over one or two indices,
   joined along a path, are a matrix product: transposes where a factor is walked
   backwards, ``diag(u)`` for a vector on an interior index, ``∘`` for factors over the
   same two indices, an all-ones vector where an end index is summed over alone.
2. **Kronecker products.** Chains over one row and one column index are the factors of a
   Kronecker product in row order; when the columns (rows) come out with two neighbouring
   groups swapped, a commutation ``I ⊗ K ⊗ I`` on the right (left) restores them. A chain
   over two row (column) indices is ``vec_r(·)`` (``vec_r(·)^T``), and so is a stored
   derivative all of whose indices are rows (columns); a delta between free indices is an
   identity, a free index that no factor carries an all-ones vector.
3. **Stored derivatives.** A term with one factor ``J`` over three or more indices (a named
   derivative with its own layout) is ``Op · J`` when ``J``'s columns are the term's, or
   ``J · Op`` when its rows are, with ``Op`` from rules 1–2; factors over ``J``'s row
   indices alone scale its rows, ``diag(vec_r(·)) J``. A row vector summed over ``J``'s
   rows (a loss's tangent) is ``vec_r(Gᵀ J)ᵀ``, ``G`` the other factors over those rows.
4. **Elementwise products.** Groups of factors that share only free indices (such as the
   row-wise ``X[i,p] J[i,j,q]``) are the ``∘`` product of their forms by rules 1–3, each
   broadcast by all-ones vectors over the free indices it lacks.

Anything else returns ``None``: the index form stands. Every matrix expression evaluates
to a dense array (:meth:`MatExpr.evaluate`, building the Kronecker and commutation
matrices), so a printed formula can be checked against the generated code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import sympy as sp

from .indexform import Apply, Delta, Expr, Index, Ref, Term

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # positions of the row and column indices
#: Rule 4 stops here: a longer chain of broadcast ``∘`` products reads worse than indices.
MAX_HADAMARD = 3


def _size(dims: tuple[sp.Expr, ...]) -> sp.Expr:
    return sp.Mul(*dims)


class MatExpr:
    """A matrix expression; ``shape`` in the size symbols, ``evaluate`` a dense array."""

    def shape(self) -> tuple[sp.Expr, sp.Expr]:
        raise NotImplementedError

    def evaluate(self, values: dict[str, np.ndarray], dims: dict) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class MatLeaf(MatExpr):
    """A named tensor (or an elementwise function of one) as a matrix: its indices at
    positions ``rows`` form the rows, those at ``cols`` the columns (a vector: a column)."""

    factor: Ref | Apply
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def shape(self):
        dims = [i.dim for i in self.factor.indices]
        return _size(tuple(dims[k] for k in self.rows)), _size(tuple(dims[k] for k in self.cols))

    def evaluate(self, values, dims):
        from .evaluate import evaluate_expr

        indices = tuple(Index(f"_m{k}", i.dim) for k, i in enumerate(self.factor.indices))
        factor = self.factor.renamed(dict(zip(self.factor.indices, indices)))
        array = evaluate_expr(None, Expr([Term(sp.Integer(1), (factor,))], indices),
                              values, dims)
        array = np.transpose(array, self.rows + self.cols)
        rows = int(np.prod([array.shape[k] for k in range(len(self.rows))]))
        return array.reshape(rows, -1)


@dataclass(frozen=True)
class MatIdentity(MatExpr):
    dim: sp.Expr

    def shape(self):
        return self.dim, self.dim

    def evaluate(self, values, dims):
        return np.eye(int(self.dim.subs(dims)))


@dataclass(frozen=True)
class MatOnes(MatExpr):
    """The all-ones column vector ``1_dim``."""

    dim: sp.Expr

    def shape(self):
        return self.dim, sp.Integer(1)

    def evaluate(self, values, dims):
        return np.ones((int(self.dim.subs(dims)), 1))


@dataclass(frozen=True)
class MatZero(MatExpr):
    rows: sp.Expr
    cols: sp.Expr

    def shape(self):
        return self.rows, self.cols

    def evaluate(self, values, dims):
        return np.zeros((int(self.rows.subs(dims)), int(self.cols.subs(dims))))


@dataclass(frozen=True)
class MatCommutation(MatExpr):
    """``K_{m,n}``: ``K_{m,n} vec(A) = vec(A^T)`` for ``A`` of shape ``m×n``."""

    m: sp.Expr
    n: sp.Expr

    def shape(self):
        return self.m * self.n, self.m * self.n

    def evaluate(self, values, dims):
        m, n = int(self.m.subs(dims)), int(self.n.subs(dims))
        K = np.zeros((m * n, m * n))
        for i, j in itertools.product(range(m), range(n)):
            K[i * n + j, j * m + i] = 1.0
        return K


@dataclass(frozen=True)
class MatTranspose(MatExpr):
    arg: MatExpr

    def shape(self):
        rows, cols = self.arg.shape()
        return cols, rows

    def evaluate(self, values, dims):
        return self.arg.evaluate(values, dims).T


@dataclass(frozen=True)
class MatDiag(MatExpr):
    """``diag(u)`` of a column vector ``u``."""

    arg: MatExpr

    def shape(self):
        rows, _ = self.arg.shape()
        return rows, rows

    def evaluate(self, values, dims):
        return np.diag(self.arg.evaluate(values, dims)[:, 0])


@dataclass(frozen=True)
class MatVec(MatExpr):
    """``vec_r(A)`` (a column), or its transpose ``vec_r(A)^T`` (a row) when ``row``."""

    arg: MatExpr
    row: bool = False

    def shape(self):
        rows, cols = self.arg.shape()
        return (sp.Integer(1), rows * cols) if self.row else (rows * cols, sp.Integer(1))

    def evaluate(self, values, dims):
        flat = self.arg.evaluate(values, dims).reshape(-1, 1)
        return flat.T if self.row else flat


@dataclass(frozen=True)
class MatProduct(MatExpr):
    args: tuple[MatExpr, ...]

    def shape(self):
        return self.args[0].shape()[0], self.args[-1].shape()[1]

    def evaluate(self, values, dims):
        out = self.args[0].evaluate(values, dims)
        for arg in self.args[1:]:
            out = out @ arg.evaluate(values, dims)
        return out


@dataclass(frozen=True)
class MatHadamard(MatExpr):
    args: tuple[MatExpr, ...]

    def shape(self):
        return self.args[0].shape()

    def evaluate(self, values, dims):
        out = self.args[0].evaluate(values, dims)
        for arg in self.args[1:]:
            out = out * arg.evaluate(values, dims)
        return out


@dataclass(frozen=True)
class MatKron(MatExpr):
    """The Kronecker product of ``args`` (``1×1`` arguments are scalar factors)."""

    args: tuple[MatExpr, ...]

    def shape(self):
        shapes = [a.shape() for a in self.args]
        return sp.Mul(*(s[0] for s in shapes)), sp.Mul(*(s[1] for s in shapes))

    def evaluate(self, values, dims):
        out = np.ones((1, 1))
        for arg in self.args:
            out = np.kron(out, arg.evaluate(values, dims))
        return out


@dataclass(frozen=True)
class MatScaled(MatExpr):
    coeff: sp.Expr
    arg: MatExpr

    def shape(self):
        return self.arg.shape()

    def evaluate(self, values, dims):
        return float(self.coeff.subs(dims)) * self.arg.evaluate(values, dims)


@dataclass(frozen=True)
class MatSum(MatExpr):
    args: tuple[MatExpr, ...]

    def shape(self):
        return self.args[0].shape()

    def evaluate(self, values, dims):
        return sum(a.evaluate(values, dims) for a in self.args)


def tensor_layout(indices: tuple[Index, ...], first: tuple[Index, ...],
                  second: tuple[Index, ...]) -> Layout | None:
    """The paper layout of a tensor over ``indices`` derived along directions ``first``
    and ``second``: columns are the last direction's indices it carries, rows the rest;
    a plain matrix is rows × columns, a vector a column; ``None`` for a tensor of three
    or more indices that carries no direction."""
    for direction in (second, first):
        cols = tuple(k for k, i in enumerate(indices) if i in direction)
        if cols:
            return tuple(k for k in range(len(indices)) if k not in cols), cols
    if len(indices) > 2:
        return None
    return tuple(range(len(indices)))[:1], tuple(range(len(indices)))[1:]


def to_matrix(expr: Expr, rows: tuple[Index, ...], cols: tuple[Index, ...],
              layouts: dict[str, Layout | None]) -> MatExpr | None:
    """``expr`` (free indices ``rows + cols`` in any order) as a matrix with rows
    ``vec_r`` over ``rows`` and columns over ``cols``, or ``None`` where no rule applies.
    ``layouts`` gives the layout of every named tensor of three or more indices."""
    if expr.is_zero:
        return MatZero(_size(tuple(i.dim for i in rows)), _size(tuple(i.dim for i in cols)))
    pieces = []
    for term in expr.terms:
        matrix = _term(term, rows, cols, layouts)
        if matrix is None:
            return None
        pieces.append(matrix if term.coeff == 1 else MatScaled(term.coeff, matrix))
    return pieces[0] if len(pieces) == 1 else MatSum(tuple(pieces))


def _term(term: Term, rows, cols, layouts) -> MatExpr | None:
    matrix = _product_term(term, rows, cols, layouts)
    if matrix is not None:
        return matrix
    # rule 4: factors that share only free indices are an elementwise product of their
    # Kronecker forms (each broadcast over the indices it lacks by all-ones vectors)
    free = set(rows) | set(cols)
    groups = _components(list(term.factors), linking=lambda i: i not in free)
    if not 2 <= len(groups) <= MAX_HADAMARD:
        return None
    parts = [_product_term(Term(sp.Integer(1), tuple(g)), rows, cols, layouts)
             for g in groups]
    return None if any(p is None for p in parts) else MatHadamard(tuple(parts))


def _product_term(term: Term, rows, cols, layouts) -> MatExpr | None:
    """Rules 1-3 for one term (its coefficient aside)."""
    big = [f for f in term.data_factors if len(f.indices) > 2]
    if not big:
        return _kronecker(term.factors, rows, cols)
    if (len(big) > 1 or layouts.get(big[0].name) is None
            or len(set(big[0].indices)) != len(big[0].indices)):  # (a diagonal J[i, j, j])
        return None
    if len(term.factors) == 1 and set(big[0].indices) <= set(rows) | set(cols):
        matrix = _kronecker(term.factors, rows, cols, layouts)
        if matrix is not None:
            return matrix  # else rule 3: broadcast inside its rows or columns
    J = big[0]
    rest = [f for f in term.factors if f is not J]
    row_pos, col_pos = layouts[J.name]
    j_rows = tuple(J.indices[k] for k in row_pos)
    j_cols = tuple(J.indices[k] for k in col_pos)
    leaf = MatLeaf(J, row_pos, col_pos)
    elsewhere = {i for f in rest for i in f.indices}
    if j_cols == tuple(cols) and not set(j_cols) & elsewhere:
        # factors over J's row indices only scale its rows: diag(vec_r(...)) J
        scale = [f for f in rest if not isinstance(f, Delta) and set(f.indices) <= set(j_rows)]
        if scale:
            weights = _kronecker(scale, j_rows, ())
            if weights is None:
                return None
            leaf = MatProduct((MatDiag(weights), leaf))
            rest = [f for f in rest if f not in scale]
        inner, ties = _inner(j_rows, set(rows))
        op = _kronecker(rest + ties, rows, inner)
        return None if op is None else _product(op, leaf)
    if j_rows == tuple(rows) and not set(j_rows) & elsewhere:
        inner, ties = _inner(j_cols, set(cols))
        op = _kronecker(rest + ties, inner, cols)
        return None if op is None else _product(leaf, op)
    others = tuple(i for i in cols if i not in j_cols)
    if (not rows and tuple(cols) == others + j_cols and not set(j_cols) & elsewhere
            and not set(j_rows) & set(cols)):
        # a row vector summed over J's rows: Σ_rows G[rows, others] J[rows, j_cols] is
        # vec_r(Gᵀ J)ᵀ
        weights = _term(Term(sp.Integer(1), tuple(rest)), j_rows, others, layouts)
        if weights is not None:
            return MatVec(_product(MatTranspose(weights), leaf), row=True)
    return None


def _inner(indices: tuple[Index, ...], free: set[Index]) -> tuple[tuple[Index, ...], list]:
    """``indices`` with the free ones replaced by fresh copies tied to them by deltas."""
    inner, ties = [], []
    for index in indices:
        if index in free:
            fresh = Index(index.name + "'", index.dim)
            inner.append(fresh)
            ties.append(Delta(index, fresh))
        else:
            inner.append(index)
    return tuple(inner), ties


def _product(left: MatExpr, right: MatExpr) -> MatExpr:
    """``left · right``, dropping identities."""
    if isinstance(left, MatIdentity):
        return right
    if isinstance(right, MatIdentity):
        return left
    return MatProduct((left, right))


# -- rule 1: chains ---------------------------------------------------------------------
def _components(factors: list, linking=lambda index: True) -> list[list]:
    """Factors grouped by the (``linking``) indices they share: connected components."""
    groups: list[tuple[set, list]] = []
    for factor in factors:
        own = {i for i in factor.indices if linking(i)}
        touching = [g for g in groups if g[0] & own]
        indices, members = own, [factor]
        for g in touching:
            indices |= g[0]
            members = g[1] + members
            groups.remove(g)
        groups.append((indices, members))
    return [members for _, members in groups]


def _leaf(factor, forward: bool) -> MatExpr:
    if isinstance(factor, Delta):
        return MatIdentity(factor.a.dim)
    leaf = MatLeaf(factor, (0,), (1,)) if len(factor.indices) == 2 else MatLeaf(factor, (0,), ())
    return leaf if forward else MatTranspose(leaf)


def _hadamard(items: list[MatExpr]) -> MatExpr:
    return items[0] if len(items) == 1 else MatHadamard(tuple(items))


def _chain(factors: list, start: Index | None, free: set[Index]) -> MatExpr | None:
    """The component ``factors`` as a matrix product walked from ``start`` (a free index,
    or ``None`` for a scalar component): rows over ``start``, columns over the other free
    end, a column vector when that end is summed."""
    if any(len(set(f.indices)) != len(f.indices) or len(f.indices) > 2 for f in factors):
        return None
    if all(not f.indices for f in factors):  # scalar tensors
        leaves = [MatLeaf(f, (), ()) for f in factors]
        return leaves[0] if len(leaves) == 1 else MatProduct(tuple(leaves))
    vectors: dict[Index, list] = {}
    edges: dict[frozenset, list] = {}
    for f in factors:
        if len(f.indices) == 1:
            vectors.setdefault(f.indices[0], []).append(f)
        else:
            edges.setdefault(frozenset(f.indices), []).append(f)
    nodes = {i for f in factors for i in f.indices}
    degree = {n: sum(n in e for e in edges) for n in nodes}
    if any(v > 2 for v in degree.values()) or len(edges) != len(nodes) - 1:
        return None  # not a path: a trace, a branching sum or a repeated pair of indices
    ends = [n for n in nodes if degree[n] <= 1]
    if any(degree[i] > 1 for i in free):
        return None  # a free index inside the path: a row-wise (face-splitting) product
    if start is None:
        start = min(ends, key=lambda i: i.name)
    if start not in ends:
        return None
    if not edges and start not in free:  # sums over one index: 1^T u, u^T v, u^T (v ∘ w)
        column = vectors[start]
        head = MatTranspose(_leaf(column[0], True) if len(column) > 1 else MatOnes(start.dim))
        tail = _hadamard([_leaf(f, True) for f in column[len(column) > 1:]])
        return MatProduct((head, tail))
    items: list[MatExpr] = []
    here, remaining = start, dict(edges)

    def node_vector(index: Index) -> MatExpr:
        return _hadamard([_leaf(f, True) for f in vectors[index]])

    if here in vectors:
        if here in free:
            items.append(MatDiag(node_vector(here)) if remaining else node_vector(here))
        else:
            items.append(MatTranspose(node_vector(here)))
    elif here not in free:
        items.append(MatTranspose(MatOnes(here.dim)))
    while remaining:
        key = next(k for k in remaining if here in k)
        group = remaining.pop(key)
        following = next(iter(key - {here}))
        items.append(_hadamard([_leaf(f, isinstance(f, Delta) or f.indices[0] == here)
                                for f in group]))
        here = following
        last = not remaining
        if here in vectors:
            if last and here not in free:
                items.append(node_vector(here))
            else:
                items.append(MatDiag(node_vector(here)))
        elif last and here not in free:
            items.append(MatOnes(here.dim))
    items = [i for i in items if not isinstance(i, MatIdentity)] or items[:1]
    return items[0] if len(items) == 1 else MatProduct(tuple(items))


# -- rule 2: Kronecker products -----------------------------------------------------------
@dataclass
class _Piece:
    matrix: MatExpr
    rows: tuple[Index, ...]
    cols: tuple[Index, ...]


def _piece(factors: list, rows: tuple, cols: tuple) -> _Piece | None:
    indices = {i for f in factors for i in f.indices}
    in_rows = [i for i in rows if i in indices]
    in_cols = [i for i in cols if i in indices]
    free = set(in_rows + in_cols)
    if len(free) > 2:
        return None
    if len(in_rows) == 1 and len(in_cols) == 1:
        matrix = _chain(factors, in_rows[0], free)
    elif len(in_rows) == 2 or len(in_cols) == 2:
        pair = in_rows or in_cols
        matrix = _chain(factors, pair[0], free)
        if matrix is not None:
            matrix = MatVec(matrix, row=bool(in_cols))
    elif len(in_rows) == 1:
        matrix = _chain(factors, in_rows[0], free)
    elif len(in_cols) == 1:
        matrix = _chain(factors, in_cols[0], free)
        if matrix is not None:
            matrix = MatTranspose(matrix)
    else:
        matrix = _chain(factors, None, free)
    return None if matrix is None else _Piece(matrix, tuple(in_rows), tuple(in_cols))


def _swap(order: tuple, wanted: tuple) -> tuple[int, int, int] | None:
    """``(a, b, c)`` when ``order`` is ``wanted`` with its neighbouring groups
    ``wanted[a:a+b]`` and ``wanted[a+b:a+b+c]`` swapped (``(0, 0, 0)``: already equal)."""
    if order == wanted:
        return 0, 0, 0
    n = len(wanted)
    return next(((a, b, c) for a in range(n) for b in range(1, n - a)
                 for c in range(1, n - a - b + 1)
                 if order == wanted[:a] + wanted[a + b:a + b + c] + wanted[a:a + b]
                 + wanted[a + b + c:]), None)


def _permutation(indices: tuple[Index, ...], swap: tuple[int, int, int],
                 left: bool) -> MatExpr:
    """The commutation ``I ⊗ K ⊗ I`` that restores ``indices`` (rows, ``left``; else
    columns) from the order with ``swap``'s two groups exchanged."""
    a, b, c = swap
    before, first, second, after = (_size(tuple(i.dim for i in part)) for part in (
        indices[:a], indices[a:a + b], indices[a + b:a + b + c], indices[a + b + c:]))
    K = MatCommutation(first, second) if left else MatCommutation(second, first)
    items = [m for m in (MatIdentity(before), K, MatIdentity(after)) if m.shape()[0] != 1]
    return items[0] if len(items) == 1 else MatKron(tuple(items))


def _kronecker(factors: list, rows: tuple, cols: tuple,
               layouts: dict | None = None) -> MatExpr | None:
    """Rule 2: ``factors`` as the Kronecker product of their connected components' forms (a
    stored derivative as itself, or ``vec_r`` of it where all its indices are rows or all
    columns), all-ones vectors for free indices no factor carries, in an order that gives
    ``rows`` and ``cols`` up to one swap of neighbouring groups each (a commutation)."""
    pieces = []
    for component in _components(list(factors)):
        if len(component) == 1 and len(component[0].indices) > 2:  # a stored derivative
            J = component[0]
            row_pos, col_pos = layouts[J.name]
            leaf = MatLeaf(J, row_pos, col_pos)
            j_rows = tuple(J.indices[k] for k in row_pos)
            j_cols = tuple(J.indices[k] for k in col_pos)
            if j_cols and set(J.indices) <= set(rows):  # all its indices rows: vec_r(J)
                pieces.append(_Piece(MatVec(leaf), j_rows + j_cols, ()))
            elif j_rows and set(J.indices) <= set(cols):  # all columns: vec_r(J)^T
                pieces.append(_Piece(MatVec(leaf, row=True), (), j_rows + j_cols))
            else:
                pieces.append(_Piece(leaf, j_rows, j_cols))
            continue
        piece = _piece(component, rows, cols)
        if piece is None:
            return None
        pieces.append(piece)
    carried = {i for f in factors for i in f.indices}
    for index in rows:
        if index not in carried:
            pieces.append(_Piece(MatOnes(index.dim), (index,), ()))
    for index in cols:
        if index not in carried:
            pieces.append(_Piece(MatTranspose(MatOnes(index.dim)), (), (index,)))
    scalars = [p.matrix for p in pieces if not p.rows and not p.cols]
    pieces = [p for p in pieces if p.rows or p.cols]
    if len(pieces) > 6:
        return None
    best = None
    for order in itertools.permutations(pieces):
        row_order = tuple(i for p in order for i in p.rows)
        col_order = tuple(i for p in order for i in p.cols)
        row_swap, col_swap = _swap(row_order, tuple(rows)), _swap(col_order, tuple(cols))
        if row_swap is None or col_swap is None:
            continue
        cost = (row_swap[1] > 0) + (col_swap[1] > 0)
        if best is None or cost < best[0]:
            best = (cost, order, row_swap, col_swap)
        if cost == 0:
            break
    if best is None:
        return None
    _, order, row_swap, col_swap = best
    matrix = _kron_of([*scalars, *(p.matrix for p in order)])
    if row_swap[1]:
        matrix = MatProduct((_permutation(tuple(rows), row_swap, left=True), matrix))
    if col_swap[1]:
        matrix = MatProduct((matrix, _permutation(tuple(cols), col_swap, left=False)))
    return matrix


def _kron_of(items: list[MatExpr]) -> MatExpr:
    """The Kronecker product of ``items``: neighbouring identities merged, a column vector
    followed by a row vector written as their outer product."""
    merged: list[MatExpr] = []
    for item in items:
        if merged and isinstance(item, MatIdentity) and isinstance(merged[-1], MatIdentity):
            merged[-1] = MatIdentity(merged[-1].dim * item.dim)
        elif (merged and merged[-1].shape()[1] == 1 and item.shape()[0] == 1
                and merged[-1].shape()[0] != 1):
            merged[-1] = MatProduct((merged[-1], item))
        else:
            merged.append(item)
    return merged[0] if len(merged) == 1 else MatKron(tuple(merged))
