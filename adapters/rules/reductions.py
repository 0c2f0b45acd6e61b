"""Rules of reductions: ``sum`` and ``mean`` over dimensions (an einsum that drops them) and
``linalg_vector_norm`` of order 2 (``sqrt(Σ x²)``, its square root guarded positive)."""

from __future__ import annotations

import sympy as sp
import torch

from ...derivations.functions import x
from ..builder import Builder
from ..nodes import _path
from ..records import Value, _symbol
from .registry import rule

aten = torch.ops.aten


def _reduce(reader: Builder, node, source, dims, keepdim: bool, mean: bool) -> Value:
    value = reader.value(source)
    rank = len(value.dims)
    dims = range(rank) if dims is None or dims == [] else [dims] if isinstance(
        dims, int) else dims
    reduced = {d % rank for d in dims}
    leaves = reader.leaf_dims(value)
    if any(reader.is_batch(a) for d in reduced for a in leaves[d]):
        raise reader.refuse("a sum over the features of each sample, not over the batch")
    sizes = [[a.size.root() for a in dim] for dim in leaves]
    out_sizes = [([] if k in reduced else s) for k, s in enumerate(sizes) if
                 keepdim or k not in reduced]
    labels = reader.out_labels(out_sizes)
    value_labels, position = [], 0
    for k, dim in enumerate(leaves):
        if k in reduced:
            value_labels.append([reader.label() for _ in dim])
            if keepdim:
                position += 1
        else:
            value_labels.append(labels[position])
            position += 1
    count = sp.Mul(*[_symbol(a.size) for d in reduced for a in leaves[d]])
    coeff, base = reader.scaled(value)
    if mean:
        coeff = coeff / count
    return reader.emit(out_sizes, labels, [(coeff, [reader.operand(base, value_labels)])])


@rule(aten.mean.dim, aten.mean.default)
def read_mean(reader: Builder, node, source, dims=None, keepdim=False, **kwargs) -> Value:
    return _reduce(reader, node, source, dims, keepdim, mean=True)


@rule(aten.sum.dim_IntList, aten.sum.default)
def read_sum(reader: Builder, node, source, dims=None, keepdim=False, **kwargs) -> Value:
    return _reduce(reader, node, source, dims, keepdim, mean=False)


@rule(aten.linalg_vector_norm.default)
def read_vector_norm(reader: Builder, node, source, ord=2, dim=None, keepdim=False, dtype=None
                      ) -> Value:
    """``‖x‖₂`` over ``dim``: ``sqrt(Σ x²)``, the sum of squares a program tensor; where it is
    0 the norm has no derivative (torch's backward gives 0 there), which a guard refuses."""
    if ord != 2:
        raise reader.refuse(f"a vector norm of order 2 (this one has ord = {ord})")
    value = reader.value(source)
    rank = len(value.dims)
    chosen = range(rank) if dim is None or dim == [] else [dim] if isinstance(dim, int) else dim
    reduced = {d % rank for d in chosen}
    leaves = reader.leaf_dims(value)
    if any(reader.is_batch(a) for d in reduced for a in leaves[d]):
        raise reader.refuse("a norm over the features of each sample, not over the batch")
    sizes = [[a.size.root() for a in d] for d in leaves]
    out_sizes = [([] if k in reduced else s) for k, s in enumerate(sizes)
                 if keepdim or k not in reduced]
    labels = reader.out_labels(out_sizes)
    value_labels, position = [], 0
    for k, d in enumerate(leaves):
        if k in reduced:
            value_labels.append([reader.label() for _ in d])
            position += keepdim
        else:
            value_labels.append(labels[position])
            position += 1
    coeff, base = reader.scaled(value)
    squares = reader.emit(out_sizes, labels, [(coeff ** 2, [reader.operand(base, value_labels),
                                                         reader.operand(base, value_labels)])],
                        f"{node.name}_squares")
    reader.guards.append((squares.tensor, squares.tensor,
                        f"the norm at {_path(node) or 'the module'} is 0 for some row, where "
                        "it has no derivative (torch's backward takes 0 there); change the "
                        "input"))
    return Value(squares.dims, squares.tensor, squares.axes, sp.sqrt(x),
                 origin=(node.name, reader.what(), reader.where()))
