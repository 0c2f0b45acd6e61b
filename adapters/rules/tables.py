"""Rules of lookups: ``embedding`` (token ids as ``X`` become their one-hot rows, the
embedding the linear map ``X W``; a padding row a constant), ``index`` / ``index_select`` /
``gather`` by constant indices (the indices' one-hot rows), ``topk``'s values (its indices a
constant, as autograd has them), and interpolation along fixed sizes (a linear map whose
matrix the operation itself makes at call time on an identity basis); with the makers of
the selection and placement tables the shape rules record."""

from __future__ import annotations

import math
import operator

import sympy as sp
import torch

from ..axes import Axis, align
from ..builder import Builder
from ..records import TOKENS, Value, _extent
from .registry import makes, rule

aten = torch.ops.aten


@rule(aten.index.Tensor)
def read_index(reader: Builder, node, source, indices) -> Value:
    """``source[..., idx, ...]`` with one constant index tensor ``idx`` (the others
    ``None``): the product with the one-hot rows of ``idx``, as an embedding."""
    value = reader.value(source)
    at = [k for k, index in enumerate(indices) if index is not None]
    if len(at) != 1:
        raise reader.refuse("an index by one tensor along one dimension")
    dim = at[0]
    ids = reader.value(indices[dim])
    full = reader.leaf_dims(value)[dim]  # one axis, or its factors (row-major)
    if ids.constant is None or ids.constant == TOKENS or not full or not all(
            isinstance(a.extent, int) for a in full):
        raise reader.refuse("an index by a constant integer tensor along a dimension of "
                          "fixed size")
    total = math.prod(a.extent for a in full)
    # the dimension's own axes (their classes, split or not later, keep its factors)
    hot = Value(ids.dims + [[Axis(a.size.root()) for a in value.dims[dim]]],
                constant=ids.constant, transform=f"index:{total}")
    return _by_rows(reader, value, dim, hot)


def _by_rows(reader: Builder, value: Value, dim: int, hot: Value) -> Value:
    """``value``'s dimension ``dim`` (an axis or its factors) contracted with the last of
    ``hot`` (one-hot rows over the same factors): ``out[.., i.., ..] = Σ_r hot[i.., r]
    value[.., r, ..]``, ``hot``'s other dimensions in place of ``dim``."""
    sizes = [[a.size.root() for a in d] for d in reader.leaf_dims(value)]
    picked = [[a.size.root() for a in d] for d in reader.leaf_dims(hot)[:-1]]
    out_sizes = sizes[:dim] + picked + sizes[dim + 1:]
    labels = reader.out_labels(out_sizes)
    inner = [reader.label() for _ in sizes[dim]]
    return reader.emit(out_sizes, labels, [(sp.Integer(1), [
        reader.operand(value, labels[:dim] + [inner] + labels[dim + len(picked):]),
        reader.operand(hot, labels[dim:dim + len(picked)] + [inner])])])


@rule(aten.embedding.default)
def read_embedding(reader: Builder, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                    sparse=False) -> Value:
    """The table's rows picked by the indices: the product with their one-hot rows. The
    row ``padding_idx`` is read as torch's backward has it, as a constant (no derivative
    flows into it): a zero one-hot row, the table's row added at call time."""
    if scale_grad_by_freq:
        raise reader.refuse("an embedding without scale_grad_by_freq (its backward divides "
                          "each row's gradient by how often its index occurs in the batch, "
                          "which is no derivative of the forward)")
    table = reader.value(weight)
    ids = reader.value(indices)
    rows = reader.leaf_dims(table)[0]
    if len(rows) != 1:
        raise reader.refuse("an embedding table with one row axis")
    padding = f":{padding_idx}" if padding_idx >= 0 else ""
    if ids.constant == TOKENS:
        picked = _embedded_tokens(reader, table, ids, padding_idx)
    elif ids.constant is None:
        raise reader.refuse("embedding indices that do not depend on X or the parameters")
    else:
        hot = Value(ids.dims + [[Axis(rows[0].size.root())]], constant=ids.constant,
                    transform=f"one_hot:{rows[0].extent}{padding}")
        picked = _by_rows(reader, table, 0, hot)
    if not padding:
        return picked
    if table.tensor is None or not isinstance(weight, torch.fx.Node):
        raise reader.refuse("an embedding table that is a tensor of the module")
    width = reader.leaf_dims(table)[1]
    constant = Value(ids.dims + [[Axis(a.size.root()) for a in width]],
                     constant=(indices.name, weight.name), transform=f"padding{padding}")
    return reader.combine([picked, constant], [(1, [0]), (1, [1])])


def _embedded_tokens(reader: Builder, table: Value, ids: Value, padding_idx: int = -1) -> Value:
    """``X W`` with ``X`` the one-hot rows of the token ids (one per id, over the
    vocabulary: the table's rows; the row of ``padding_idx``'s id all zeros)."""
    rows = reader.leaf_dims(table)[0]
    if len(rows) != 1 or "X" in reader.inputs:
        raise reader.refuse("token ids read by one embedding table of one row axis")
    vocabulary = rows[0].size.root()
    reader.hints[vocabulary] = "V"
    dims = reader.leaf_dims(ids) + [[Axis(vocabulary)]]
    X = Value(dims, "X", [a for dim in dims for a in dim])
    reader.inputs["X"] = ("input", X)
    reader._tensor_axes["X"] = X.axes
    reader.vocabulary = int(vocabulary.extent)
    reader.padding = padding_idx if padding_idx >= 0 else None
    return _by_rows(reader, table, 0, X)


def _indices(reader: Builder, index, what: str) -> Value:
    ids = reader.value(index)
    if ids.constant is None or ids.constant == TOKENS:
        raise reader.refuse(f"{what} by constant integer indices (computed without X's "
                          "derivatives: autograd treats them as constants too)")
    return ids


def _fixed(reader: Builder, value: Value, dim: int) -> int:
    full = reader.leaf_dims(value)[dim]
    if not all(isinstance(a.extent, int) for a in full):
        raise reader.refuse("a selection along a dimension of fixed size")
    return int(sp.Mul(*[a.extent for a in full]))


def _hot(reader: Builder, ids: Value, value: Value, dim: int) -> Value:
    """The one-hot rows of the constant indices ``ids`` over ``value``'s dimension ``dim``
    (its own axes: their classes keep its factors), one program constant however often
    read."""
    total = _fixed(reader, value, dim)
    key = ("one-hot rows", ids.constant, total)  # the pass's declarations hold it
    if key not in reader.declared:
        reader.declared[key] = Value(ids.dims + [[Axis(a.size.root()) for a in value.dims[dim]]],
                                   constant=ids.constant, transform=f"index:{total}")
    return reader.declared[key]


@rule(aten.index_select.default)
def read_index_select(reader: Builder, node, source, dim, index) -> Value:
    """``source.index_select(dim, index)``: the one-hot rows of ``index`` times ``source``
    along ``dim``."""
    value = reader.value(source)
    dim %= len(value.dims)
    ids = _indices(reader, index, "an index_select")
    return _by_rows(reader, value, dim, _hot(reader, ids, value, dim))


def _gathered(reader: Builder, value: Value, dim: int, ids: Value, id_shape: list,
              value_shape: list, key: str) -> Value:
    """``out[i.., j, k..] = value[i.., ids[i.., j, k..], k..]``: ``Σ_r onehot(ids)[i.., j,
    k.., r] value[i.., r, k..]``, ``ids``'s other dimensions those of ``value``."""
    if len(ids.dims) != len(value.dims):
        raise reader.refuse("a gather by indices of the tensor's rank")
    hot = _hot(reader, ids, value, dim)
    for k in range(len(value.dims)):
        if k == dim:
            continue
        if sp.simplify(sp.sympify(id_shape[k]) - value_shape[k]) != 0:
            raise reader.refuse("a gather by indices of the tensor's own extents along every "
                              "other dimension")
        a, b = reader.leaf_dims(hot)[k], reader.leaf_dims(value)[k]
        if a and b:
            align([s.size for s in a], [s.size for s in b])
    leaves = reader.leaf_dims(value)
    picked = reader.leaf_dims(hot)[:-1]
    sizes = [[a.size.root() for a in d] for d in leaves]
    sizes[dim] = [a.size.root() for a in picked[dim]]
    labels = reader.out_labels(sizes)
    inner = [reader.label() for _ in leaves[dim]]
    value_labels = [list(d) for d in labels]
    value_labels[dim] = inner
    hot_labels = [list(d) if picked[k] else [] for k, d in enumerate(labels)] + [inner]
    coeff, base = reader.scaled(value)
    return reader.emit(sizes, labels, [(coeff, [reader.operand(base, value_labels),
                                              reader.operand(hot, hot_labels)])], key)


@rule(aten.gather.default)
def read_gather(reader: Builder, node, source, dim, index, sparse_grad=False) -> Value:
    value = reader.value(source)
    ids = _indices(reader, index, "a gather")
    return _gathered(reader, value, dim % len(value.dims), ids, reader.shape_of(index),
                     reader.shape_of(source), node.name)


@rule(aten.topk.default)
def read_topk(reader: Builder, node, source, k, dim=-1, largest=True, sorted=True) -> tuple:
    """``topk``'s values: ``gather(source, dim, indices)``, the indices the constant the
    module computes (its second output)."""
    value = reader.value(source)
    dim %= len(value.dims)
    taken = next((user.name for user in node.users if user.target is operator.getitem
                  and user.args[1] == 1), None)  # torch.export keeps it, even unused
    if taken is None:
        raise reader.refuse("the indices of the selection as a node of the graph")
    shape = node.meta["val"][1].shape
    ids = Value(reader.fresh(tuple(shape), taken), constant=taken)
    return (_gathered(reader, value, dim, ids, [_extent(e) for e in shape],
                      reader.shape_of(source), node.name),
            ids)


def _plain(arg: object) -> object:
    """A node's argument as a hashable value (lists as tuples)."""
    if isinstance(arg, list | tuple):
        return tuple(_plain(a) for a in arg)
    return arg


_INTERPOLATIONS = [name for name in (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa") if hasattr(aten, name)]


@rule(*[getattr(aten, name) for name in _INTERPOLATIONS])
def read_interpolation(reader: Builder, node, source, *args, **kwargs) -> Value:
    """An interpolation over the trailing (spatial) dimensions of fixed sizes: ``out[..,
    p..] = Σ_q M[p.., q..] in[.., q..]``, ``M`` the operation applied to an identity basis
    (made at call time in ``X``'s dtype: the coefficients torch uses)."""
    value = reader.computed(reader.value(source), "an interpolation")
    out_shape = reader.shape_of(node)
    spatial = len(out_shape) - 2
    leaves = reader.leaf_dims(value)
    given = reader.shape_of(source)
    if any(not isinstance(e, int) for e in given[2:] + out_shape[2:]):
        raise reader.refuse("an interpolation between sizes fixed when the module is read")
    if any(reader.is_batch(a) for d in leaves[2:] for a in d):
        raise reader.refuse("an interpolation along the features, not along the batch")
    if kwargs or any(isinstance(a, torch.fx.Node) for a in args):
        raise reader.refuse("an interpolation of sizes and scales given as numbers")
    packet = str(node.target._overloadpacket).removeprefix("aten.")
    details = ("interpolate", packet, node.target._overloadname, _plain(args),
               tuple(given[2:]))
    out_dims = [reader.size((node.name, "interpolated", k), e).leaves()
                for k, e in enumerate(out_shape[2:])]
    table = reader.table("interpolate",
                       [[Axis(s) for s in d] for d in out_dims]
                       + [[Axis(a.size.root()) for a in d] for d in leaves[2:]], details)
    sizes = [[a.size.root() for a in d] for d in leaves[:2]] + out_dims
    labels = reader.out_labels(sizes)
    inner = [[reader.label() for _ in d] for d in leaves[2:]]
    coeff, base = reader.scaled(value)
    del spatial
    return reader.emit(sizes, labels, [(coeff, [
        reader.operand(base, labels[:2] + inner),
        reader.operand(table, labels[2:] + inner)])])


def _as_lists(arg: object) -> object:
    """An argument kept hashable (tuples) as the operation takes it (lists)."""
    return [_as_lists(a) for a in arg] if isinstance(arg, tuple) else arg


@makes("interpolate")
def make_interpolation(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """The matrix of an interpolation (``out[p..] = Σ_q M[p.., q..] in[q..]``): the operation
    applied to an identity basis, one image per input entry."""
    packet, overload, arguments, given = args
    n = math.prod(given)
    basis = torch.eye(n, **options).reshape(n, 1, *given)
    out = getattr(getattr(aten, packet), overload)(basis, *map(_as_lists, arguments))
    return out.reshape(n, -1).T
