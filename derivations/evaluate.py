"""A direct evaluator of index-form assignments, entry by entry, for one sample.

It reads every term literally (loops over index values, deltas as comparisons), with
SymPy or float entries, and shares nothing with the code generator: the tests use it to
prove derived expressions equal to SymPy's own derivatives of a forward definition, at
small explicit sizes, independently of lowering and printing.
"""

from __future__ import annotations

import itertools

import numpy as np
import sympy as sp

from .functions import x as fn_variable
from .graph import Assign, Graph
from .indexform import Apply, Delta, Expr, Ref


def evaluate_expr(graph: Graph, expr: Expr, values: dict[str, np.ndarray],
                  dims: dict[sp.Symbol, int]) -> np.ndarray:
    """``expr`` as an array over its free indices: float arrays when every value read is a
    float array (deltas built as identity matrices, one ``numpy.einsum`` a term), object
    arrays entry by entry otherwise (SymPy values)."""
    if all(values[name].dtype.kind == "f" for name in expr.names()):
        return _evaluate_floats(expr, values, dims)
    free = expr.free
    out = np.zeros(tuple(dims[i.dim] for i in free), dtype=object)
    applied: dict[tuple, np.ndarray] = {}
    for term in expr.terms:
        summed = [i for i in term.indices() if i not in free]
        coeff = term.coeff.subs(dims)
        for point in itertools.product(*(range(dims[i.dim]) for i in free)):
            at = dict(zip(free, point))
            total = 0
            for inner in itertools.product(*(range(dims[i.dim]) for i in summed)):
                at.update(zip(summed, inner))
                product = coeff
                for factor in term.factors:
                    if isinstance(factor, Delta):
                        product = product * int(at[factor.a] == at[factor.b])
                        continue
                    if isinstance(factor, Ref):
                        array = values[factor.name]
                    else:
                        key = (factor.fn.key, factor.name)
                        if key not in applied:
                            applied[key] = _apply(factor, values[factor.name])
                        array = applied[key]
                    product = product * array[tuple(at[i] for i in factor.indices)]
                total = total + product
            out[point] = out[point] + total
    return out


def _evaluate_floats(expr: Expr, values: dict[str, np.ndarray],
                     dims: dict[sp.Symbol, int]) -> np.ndarray:
    shape = tuple(dims[i.dim] for i in expr.free)
    out = np.zeros(shape)
    for term in expr.terms:
        letters = {i: chr(ord("a") + n) for n, i in enumerate(dict.fromkeys(
            [*expr.free, *term.indices()]))}
        operands, specs = [], []
        for factor in term.factors:
            if isinstance(factor, Delta):
                array = np.eye(dims[factor.a.dim])
            elif isinstance(factor, Ref):
                array = values[factor.name]
            else:
                fn = sp.lambdify(fn_variable, factor.fn.expr, modules=[_NUMERIC, "numpy"])
                array = np.broadcast_to(fn(values[factor.name]), values[factor.name].shape)
            operands.append(array)
            specs.append("".join(letters[i] for i in factor.indices))
        for index in expr.free:  # free indices that the term does not carry: broadcast
            if index not in term.indices():
                operands.append(np.ones(dims[index.dim]))
                specs.append(letters[index])
        spec = ",".join(specs) + "->" + "".join(letters[i] for i in expr.free)
        value = np.einsum(spec, *operands) if operands else np.ones(shape)
        out = out + float(term.coeff.subs(dims)) * value
    return out


def _step(u, *_):
    return (np.asarray(u) > 0).astype(float)


#: numeric values of the functions numpy lacks
#: The row-weight constants of :meth:`Graph.row_weights`, by reduction, for ``n`` rows.
ROW_WEIGHTS = {"rows_mean": lambda n: np.full(n, 1 / n),
               "rows_first": lambda n: (np.arange(n) == 0).astype(float),
               "rows_rest": lambda n: (np.arange(n) != 0).astype(float)}

_NUMERIC = {"Heaviside": _step, "sigmoid": lambda u: 1 / (1 + np.exp(-u)),
            "softplus": lambda u: np.logaddexp(0, u), "sech": lambda u: 1 / np.cosh(u)}


def _apply(factor: Apply, array: np.ndarray) -> np.ndarray:
    out = np.empty(array.shape, dtype=object)
    for index in np.ndindex(array.shape):
        out[index] = factor.fn.expr.subs(fn_variable, array[index])
    return out


def evaluate(graph: Graph, assigns: list[Assign], values: dict[str, np.ndarray],
             dims: dict[sp.Symbol, int]) -> dict[str, np.ndarray]:
    """Run ``assigns`` in order on ``values`` (updated in place and returned). A constant
    (a row maximum) already present in ``values`` is kept: any value of a softmax shift
    gives the same result, and 0 keeps symbolic proofs simple."""
    for assign in assigns:
        name = assign.target.name
        if assign.reduction == "causal":
            n = dims[assign.target.indices[0].dim]
            values[name] = np.triu(np.full((n, n), -np.inf), 1)
            continue
        if assign.reduction == "rotary":
            length, _, _, half = (dims[k.dim] for k in assign.target.indices)
            angle = np.arange(length)[:, None] * assign.base ** (-np.arange(half) / half)
            cos, sin = np.cos(angle), np.sin(angle)
            values[name] = np.stack([np.stack([cos, -sin], 1), np.stack([sin, cos], 1)], 1)
            continue
        if assign.reduction in ROW_WEIGHTS:
            n = dims[assign.target.indices[1].dim]
            values[name] = ROW_WEIGHTS[assign.reduction](n)[None]
            continue
        if assign.reduction == "max":
            if name not in values:
                source = values[assign.expr.terms[0].factors[0].name]
                values[name] = (source.max(-1) if source.dtype.kind == "f" else
                                np.array([sp.Max(*row) for row in source], dtype=object))
            continue
        values[name] = evaluate_expr(graph, assign.expr, values, dims)
    return values
