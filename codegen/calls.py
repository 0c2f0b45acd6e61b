"""Which plain array call computes an einsum of the lowering, when one does.

An einsum call parses its spec and permutes and reshapes its operands on every call; for
the small arrays of a Hessian-vector product that overhead is larger than the arithmetic.
The contractions the lowering emits are mostly of six simple kinds, each of which one
array call (or an indexed product) computes directly. :func:`classify` names the kind and
its axes; the printers print it, and anything else stays an einsum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sum:
    """``x.sum(axes)``: one operand, the output its axes minus ``axes``, in order."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Permute:
    """``x`` with its axes in the order ``axes``, copied into that order (a view would
    make every array computed from it follow its strides, and a reshape of those copy)."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Product:
    """``x[index_x] * y[index_y]``: nothing summed, each operand's axes already in the
    output's order; ``None`` in an index inserts a broadcast axis, ``()`` is no index."""

    indexes: tuple[tuple[bool, ...] | None, ...]


@dataclass(frozen=True)
class ProductSum:
    """``(x * y).sum(axes)``: both operands with the same axes in the same order."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Matmul:
    """``left @ right`` (``left``, ``right`` the operand numbers; a transposed operand has
    its last two axes swapped): the output is ``(lead..., M, N)``, the single summed index
    ``K``, each operand ``(its lead..., M, K)`` and ``(its lead..., K, N)`` with its lead
    axes a suffix of the output's (broadcast as matmul does)."""

    left: int
    right: int
    transpose_left: bool
    transpose_right: bool


@dataclass(frozen=True)
class MergedMatmul:
    """One matrix product of reshaped operands: the output is ``(M..., N...)``, the axes
    ``M...`` one operand's (``left``) and ``N...`` the other's, every summed index ``K...``
    in both operands, and each operand two runs of adjacent axes, ``(M..., K...)`` or
    ``(K..., M...)`` (transposed), ``(K..., N...)`` or ``(N..., K...)`` (transposed), with
    ``K...`` in the same order in both. A parameter's gradient summed over batch and
    sequence is one: ``bda,bdc->ac`` is ``(BL, a)ᵀ @ (BL, c)``. ``m``, ``k``, ``n`` count
    the axes of each run."""

    left: int
    right: int
    transpose_left: bool
    transpose_right: bool
    m: int
    k: int
    n: int


Call = Sum | Permute | Product | ProductSum | Matmul | MergedMatmul


def classify(spec: str) -> Call | None:
    """The direct call that computes the einsum ``spec``, or None."""
    inputs, out = spec.split("->")
    specs = inputs.split(",")
    if any(len(set(s)) != len(s) for s in [*specs, out]):
        return None  # a repeated index (a diagonal) stays an einsum
    if len(specs) == 1:
        return _single(specs[0], out)
    if len(specs) != 2:
        return None
    a, b = specs
    summed = (set(a) | set(b)) - set(out)
    if not summed:
        return _product(specs, out)
    if a == b and out == "".join(c for c in a if c not in summed):
        return ProductSum(tuple(a.index(c) for c in a if c in summed))
    return _matmul(a, b, out, summed) or _merged_matmul(a, b, out, summed)


def _single(spec: str, out: str) -> Call | None:
    if set(out) == set(spec):
        return Permute(tuple(spec.index(c) for c in out))
    if out == "".join(c for c in spec if c in out):
        return Sum(tuple(k for k, c in enumerate(spec) if c not in out))
    return None


def _product(specs: list[str], out: str) -> Product | None:
    indexes = []
    for spec in specs:
        if list(spec) != [c for c in out if c in spec]:
            return None  # axes out of the output's order: an einsum transposes them
        first = min(out.index(c) for c in spec) if spec else len(out)
        index = tuple(c in spec for c in out[first:])
        indexes.append(None if all(index) else index)
    return Product(tuple(indexes))


def _matmul(a: str, b: str, out: str, summed: set[str]) -> Matmul | None:
    if len(summed) != 1 or len(out) < 2 or not summed <= set(a) & set(b):
        return None
    (k,) = summed
    m, n = out[-2], out[-1]
    holders = {c: [x for x, s in enumerate((a, b)) if c in s] for c in (m, n)}
    if len(holders[m]) != 1 or len(holders[n]) != 1 or holders[m] == holders[n]:
        return None  # M and N must each come from one operand, not the same one
    left, right = holders[m][0], holders[n][0]
    lead = out[:-2]
    transposed = []
    for spec, free in (((a, b)[left], m), ((a, b)[right], n)):
        own_lead, tail = spec[:-2], spec[-2:]
        if not lead.endswith(own_lead) or set(tail) != {free, k}:
            return None
        transposed.append(tail != (free + k if free == m else k + free))
    return Matmul(left, right, *transposed)


def _merged_matmul(a: str, b: str, out: str, summed: set[str]) -> MergedMatmul | None:
    if not summed <= set(a) & set(b) or set(a) & set(b) & set(out) or not out:
        return None
    left = 0 if out[0] in a else 1
    m = "".join(c for c in out if c in (a, b)[left])
    n = out[len(m):]
    if not out.startswith(m) or not n:
        return None  # the output is not one operand's axes, then the other's
    spec_left, spec_right = (a, b)[left], (a, b)[1 - left]
    k = "".join(c for c in spec_left if c in summed)
    if spec_left not in (m + k, k + m) or spec_right not in (k + n, n + k):
        return None
    return MergedMatmul(left, 1 - left, spec_left == k + m, spec_right == n + k,
                        len(m), len(k), len(n))
