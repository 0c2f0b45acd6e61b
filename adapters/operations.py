"""Readers of further operations real Transformer modules use, each with its exact rule (the
same signature as :class:`~.reader.Reader`'s ``_read_<operation>`` methods, registered into
:data:`~.reader.READERS`):

* ``repeat``: a tiling, read as a broadcast (each repeated dimension factored into
  ``(copies, entries)``, the copies an axis the tensor lacks);
* ``pad`` / ``constant_pad_nd`` (constant mode): a placement ``S[out, in]`` along each padded
  dimension plus the fill value on the entries it adds;
* ``baddbmm``: ``β input + α batch1 @ batch2``;
* ``einsum``: its contraction, one einsum of the program;
* ``linalg_vector_norm`` (order 2): ``sqrt(Σ x²)``, an elementwise function of a sum of
  squares;
* ``gather``, ``index_select`` by constant indices (the one-hot rows of the indices, as an
  embedding), and ``topk``'s values (``gather(x, indices)``, the indices a constant: autograd
  treats them so too);
* interpolation (``upsample_*``, ``_upsample_*_aa``) along fixed sizes: a linear map with
  constant coefficients, its matrix made at call time by the operation itself on an identity
  basis.
"""

from __future__ import annotations

import operator

import sympy as sp
import torch

from ..derivations.functions import x
from .axes import Axis, align
from .reader import READERS, TOKENS, Value, _extent, _number, _path, reads

aten = torch.ops.aten


def _own(self, value: Value, what: str) -> Value:
    """``value``, refused where it is not a tensor the program computes (token ids)."""
    if value.constant is not None:
        raise self.refuse(f"{what} of a tensor computed from X or the parameters "
                          "(not of token ids)")
    return value


def _extent_of(self, dim: list[Axis]) -> int | sp.Expr:
    return sp.Mul(*[a.extent for a in dim]) if dim else 1


# -- repeat ------------------------------------------------------------------------------------
@reads(aten.repeat.default)
def _read_repeat(self, node, source, repeats) -> Value:
    """``source.repeat(r…)``: dimension ``k`` of the result is ``(r_k, n_k)`` row-major, its
    entry independent of the copy: the copies a broadcast axis (leading new dimensions
    too)."""
    value = _own(self, self.value(source), "a repeat")
    out = self.shape_of(node)
    before = self.shape_of(source)
    extra = len(out) - len(before)
    dims = [[] for _ in range(extra)] + [list(d) for d in value.dims]
    leaves = [[] for _ in range(extra)] + self.leaf_dims(value)
    for k, extent in enumerate(out):
        given = before[k - extra] if k >= extra else 1
        copies = sp.simplify(sp.sympify(extent) / given)
        if copies == 1:
            continue
        if any(self.is_batch(a) for a in leaves[k]):
            raise self.refuse("a repeat along the features, not along the batch")
        if dims[k] and not copies.is_Integer:
            raise self.refuse("a repeat along a dimension of more than one entry by a count "
                              "fixed when the module is read (this one is bound at call "
                              f"time: {copies})")
        dims[k] = [Axis(self.size((node.name, "copies", k), copies))] + dims[k]
    return self._with_dims(value, dims)


# -- constant padding --------------------------------------------------------------------------
@reads(aten.constant_pad_nd.default)
def _read_constant_pad_nd(self, node, source, pad, value=0) -> Value:
    return _padded(self, node, source, pad, value)


@reads(aten.pad.default)
def _read_pad(self, node, source, pad, mode="constant", value=None) -> Value:
    if mode != "constant":
        raise self.refuse(f"a pad in constant mode (mode = {mode!r} repeats or reflects the "
                          "tensor's own entries, which curvgap does not read)")
    return _padded(self, node, source, pad, value)


def _padded(self, node, source, pad, fill) -> Value:
    """``source`` padded by ``pad`` (pairs ``(before, after)`` from the last dimension on;
    negative: cut) with ``fill``: along each padded dimension the placement ``out[o] =
    in[o - before]`` plus ``fill`` on the entries the pad adds."""
    value = _own(self, self.value(source), "a pad")
    if any(not isinstance(p, int) for p in pad):
        raise self.refuse("a pad of fixed widths")
    try:
        fill = _number(0 if fill is None else fill)
    except (TypeError, ValueError):
        raise self.refuse(f"a finite fill value, got {fill!r}") from None
    out_shape = self.shape_of(node)
    rank = len(value.dims)
    for j in range(len(pad) // 2):
        before, after = pad[2 * j], pad[2 * j + 1]
        if before or after:
            dim = rank - 1 - j
            value = _pad_dim(self, node, value, dim, before, after, out_shape[dim], fill)
    return value


def _pad_dim(self, node, value: Value, dim: int, before: int, after: int, extent,
             fill: sp.Expr) -> Value:
    leaves = self.leaf_dims(value)
    part = leaves[dim]
    if any(self.is_batch(a) for a in part):
        raise self.refuse("a pad along the features, not along the batch")
    out_size = self.size((node.name, "padded", dim), extent).leaves()
    shift = self.table("shift", [[Axis(s) for s in out_size],
                                 [Axis(a.size.root()) for a in part]], ("shift", before))
    sizes, labels, term = self.through_table(value, dim, shift, out_size)
    terms = [term]
    if fill != 0:
        border = self.table("border", [[Axis(s) for s in out_size]],
                            ("border", max(before, 0), max(after, 0)))
        terms.append((fill, [self.operand(border, [labels[dim]])]))
    return self.emit(sizes, labels, terms, f"{node.name}_{dim}")


# -- baddbmm -----------------------------------------------------------------------------------
@reads(aten.baddbmm.default)
def _read_baddbmm(self, node, source, batch1, batch2, beta=1, alpha=1) -> Value:
    """``β source + α batch1 @ batch2`` (``source`` ignored where ``β = 0``, as torch does)."""
    product = READERS[aten.bmm.default](self, node, batch1, batch2)
    beta, alpha = _number(beta), _number(alpha)
    cp, vp = self.scaled(product)
    if beta == 0:
        return Value(vp.dims, vp.tensor, vp.axes, alpha * cp * x,
                     origin=(node.name, self.what(), self.where()))
    cs, vs = self.scaled(self.value(source))
    return self.combine([vs, vp], [(beta * cs, [0]), (alpha * cp, [1])], node.name)


# -- einsum ------------------------------------------------------------------------------------
@reads(aten.einsum.default)
def _read_einsum(self, node, equation, operands, path=None) -> Value:
    """``torch.einsum(equation, *operands)``: one einsum of the program (a letter's
    dimensions aligned across operands; a dimension of one broadcast)."""
    values = [self.value(t) for t in operands]
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    specs = lhs.split(",")
    if len(specs) != len(values):
        raise self.refuse("an einsum equation with one subscript per operand")
    hidden = max([len(v.dims) - len(s.replace("...", "")) for s, v in zip(specs, values)
                  if "..." in s] or [0])
    broadcast = [chr(0x100 + k) for k in range(hidden)]  # the ellipsis as letters of its own

    def letters(spec: str, rank: int) -> list[str]:
        if "..." in spec:
            head, _, tail = spec.partition("...")
            return list(head) + broadcast[hidden - (rank - len(head) - len(tail)):] + list(tail)
        return list(spec)

    subscripts = [letters(s, len(v.dims)) for s, v in zip(specs, values)]
    if any(len(s) != len(v.dims) for s, v in zip(subscripts, values)):
        raise self.refuse("an einsum equation with one letter per dimension of each operand")
    if any(len(set(s)) != len(s) for s in subscripts):
        raise self.refuse("an einsum without a letter repeated within one operand (a "
                          "diagonal)")
    if arrow:
        out = letters(rhs, hidden + len(rhs.replace("...", "")))
    else:
        counts: dict[str, int] = {}
        for s in subscripts:
            for letter in s:
                counts[letter] = counts.get(letter, 0) + 1
        out = broadcast + sorted(k for k, n in counts.items() if n == 1 and k not in broadcast)
    order = list(dict.fromkeys(letter for s in subscripts for letter in s))
    for letter in order:  # a letter's dimensions meet
        full = [self.leaf_dims(v)[s.index(letter)] for s, v in zip(subscripts, values)
                if letter in s and self.leaf_dims(v)[s.index(letter)]]
        for other in full[1:]:
            align([a.size for a in full[0]], [a.size for a in other])
    sizes = {}
    for letter in order:
        full = [self.leaf_dims(v)[s.index(letter)] for s, v in zip(subscripts, values)
                if letter in s and self.leaf_dims(v)[s.index(letter)]]
        sizes[letter] = [a.size.root() for a in full[0]] if full else []
    summed = [letter for letter in order if letter not in out]
    if any(size is self.batch.root() for letter in summed for size in sizes[letter]):
        raise self.refuse("an einsum that sums over the features of each sample, not over "
                          "the batch")
    out_sizes = [sizes[letter] for letter in out]
    labels = dict(zip(out, self.out_labels(out_sizes)))
    labels.update({letter: [self.label() for _ in sizes[letter]] for letter in summed})
    coeff, factors = sp.Integer(1), []
    for s, v in zip(subscripts, values):
        c, base = self.scaled(v)
        coeff *= c
        factors.append(self.operand(base, [labels[letter] if dim else []
                                           for letter, dim in zip(s, self.leaf_dims(v))]))
    return self.emit(out_sizes, [labels[letter] for letter in out], [(coeff, factors)])


# -- norms -------------------------------------------------------------------------------------
@reads(aten.linalg_vector_norm.default)
def _read_vector_norm(self, node, source, ord=2, dim=None, keepdim=False, dtype=None
                      ) -> Value:
    """``‖x‖₂`` over ``dim``: ``sqrt(Σ x²)``, the sum of squares a program tensor; where it is
    0 the norm has no derivative (torch's backward gives 0 there), which a guard refuses."""
    if ord != 2:
        raise self.refuse(f"a vector norm of order 2 (this one has ord = {ord})")
    value = self.value(source)
    rank = len(value.dims)
    chosen = range(rank) if dim is None or dim == [] else [dim] if isinstance(dim, int) else dim
    reduced = {d % rank for d in chosen}
    leaves = self.leaf_dims(value)
    if any(self.is_batch(a) for d in reduced for a in leaves[d]):
        raise self.refuse("a norm over the features of each sample, not over the batch")
    sizes = [[a.size.root() for a in d] for d in leaves]
    out_sizes = [([] if k in reduced else s) for k, s in enumerate(sizes)
                 if keepdim or k not in reduced]
    labels = self.out_labels(out_sizes)
    value_labels, position = [], 0
    for k, d in enumerate(leaves):
        if k in reduced:
            value_labels.append([self.label() for _ in d])
            position += keepdim
        else:
            value_labels.append(labels[position])
            position += 1
    coeff, base = self.scaled(value)
    squares = self.emit(out_sizes, labels, [(coeff ** 2, [self.operand(base, value_labels),
                                                         self.operand(base, value_labels)])],
                        f"{node.name}_squares")
    self.guards.append((squares.tensor, squares.tensor,
                        f"the norm at {_path(node) or 'the module'} is 0 for some row, where "
                        "it has no derivative (torch's backward takes 0 there); change the "
                        "input"))
    return Value(squares.dims, squares.tensor, squares.axes, sp.sqrt(x),
                 origin=(node.name, self.what(), self.where()))


# -- selections by constant indices ------------------------------------------------------------
def _indices(self, index, what: str) -> Value:
    ids = self.value(index)
    if ids.constant is None or ids.constant == TOKENS:
        raise self.refuse(f"{what} by constant integer indices (computed without X's "
                          "derivatives: autograd treats them as constants too)")
    return ids


def _fixed(self, value: Value, dim: int) -> int:
    full = self.leaf_dims(value)[dim]
    if not all(isinstance(a.extent, int) for a in full):
        raise self.refuse("a selection along a dimension of fixed size")
    return int(_extent_of(self, full))


def _hot(self, ids: Value, value: Value, dim: int) -> Value:
    """The one-hot rows of the constant indices ``ids`` over ``value``'s dimension ``dim``
    (its own axes: their classes keep its factors), one program constant however often
    read."""
    total = _fixed(self, value, dim)
    key = ("one-hot rows", ids.constant, total)  # the pass's declarations hold it
    if key not in self.declared:
        self.declared[key] = Value(ids.dims + [[Axis(a.size.root()) for a in value.dims[dim]]],
                                   constant=ids.constant, transform=f"index:{total}")
    return self.declared[key]


@reads(aten.index_select.default)
def _read_index_select(self, node, source, dim, index) -> Value:
    """``source.index_select(dim, index)``: the one-hot rows of ``index`` times ``source``
    along ``dim``."""
    value = self.value(source)
    dim %= len(value.dims)
    ids = _indices(self, index, "an index_select")
    return self._by_rows(value, dim, _hot(self, ids, value, dim))


def _gathered(self, value: Value, dim: int, ids: Value, id_shape: list, value_shape: list,
              key: str) -> Value:
    """``out[i.., j, k..] = value[i.., ids[i.., j, k..], k..]``: ``Σ_r onehot(ids)[i.., j,
    k.., r] value[i.., r, k..]``, ``ids``'s other dimensions those of ``value``."""
    if len(ids.dims) != len(value.dims):
        raise self.refuse("a gather by indices of the tensor's rank")
    hot = _hot(self, ids, value, dim)
    for k in range(len(value.dims)):
        if k == dim:
            continue
        if sp.simplify(sp.sympify(id_shape[k]) - value_shape[k]) != 0:
            raise self.refuse("a gather by indices of the tensor's own extents along every "
                              "other dimension")
        a, b = self.leaf_dims(hot)[k], self.leaf_dims(value)[k]
        if a and b:
            align([s.size for s in a], [s.size for s in b])
    leaves = self.leaf_dims(value)
    picked = self.leaf_dims(hot)[:-1]
    sizes = [[a.size.root() for a in d] for d in leaves]
    sizes[dim] = [a.size.root() for a in picked[dim]]
    labels = self.out_labels(sizes)
    inner = [self.label() for _ in leaves[dim]]
    value_labels = [list(d) for d in labels]
    value_labels[dim] = inner
    hot_labels = [list(d) if picked[k] else [] for k, d in enumerate(labels)] + [inner]
    coeff, base = self.scaled(value)
    return self.emit(sizes, labels, [(coeff, [self.operand(base, value_labels),
                                              self.operand(hot, hot_labels)])], key)


@reads(aten.gather.default)
def _read_gather(self, node, source, dim, index, sparse_grad=False) -> Value:
    value = self.value(source)
    ids = _indices(self, index, "a gather")
    return _gathered(self, value, dim % len(value.dims), ids, self.shape_of(index),
                     self.shape_of(source), node.name)


@reads(aten.topk.default)
def _read_topk(self, node, source, k, dim=-1, largest=True, sorted=True) -> tuple:
    """``topk``'s values: ``gather(source, dim, indices)``, the indices the constant the
    module computes (its second output)."""
    value = self.value(source)
    dim %= len(value.dims)
    taken = next((user.name for user in node.users if user.target is operator.getitem
                  and user.args[1] == 1), None)  # torch.export keeps it, even unused
    if taken is None:
        raise self.refuse("the indices of the selection as a node of the graph")
    shape = node.meta["val"][1].shape
    ids = Value(self.fresh(tuple(shape), taken), constant=taken)
    return (_gathered(self, value, dim, ids, [_extent(e) for e in shape], self.shape_of(source),
                      node.name),
            ids)


# -- interpolation -----------------------------------------------------------------------------
_INTERPOLATIONS = [name for name in (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa") if hasattr(aten, name)]


def _plain(arg: object) -> object:
    """A node's argument as a hashable value (lists as tuples)."""
    if isinstance(arg, list | tuple):
        return tuple(_plain(a) for a in arg)
    return arg


@reads(*[getattr(aten, name) for name in _INTERPOLATIONS])
def _read_interpolation(self, node, source, *args, **kwargs) -> Value:
    """An interpolation over the trailing (spatial) dimensions of fixed sizes: ``out[..,
    p..] = Σ_q M[p.., q..] in[.., q..]``, ``M`` the operation applied to an identity basis
    (made at call time in ``X``'s dtype: the coefficients torch uses)."""
    value = _own(self, self.value(source), "an interpolation")
    out_shape = self.shape_of(node)
    spatial = len(out_shape) - 2
    leaves = self.leaf_dims(value)
    given = self.shape_of(source)
    if any(not isinstance(e, int) for e in given[2:] + out_shape[2:]):
        raise self.refuse("an interpolation between sizes fixed when the module is read")
    if any(self.is_batch(a) for d in leaves[2:] for a in d):
        raise self.refuse("an interpolation along the features, not along the batch")
    if kwargs or any(isinstance(a, torch.fx.Node) for a in args):
        raise self.refuse("an interpolation of sizes and scales given as numbers")
    packet = str(node.target._overloadpacket).removeprefix("aten.")
    details = ("interpolate", packet, node.target._overloadname, _plain(args),
               tuple(given[2:]))
    out_dims = [self.size((node.name, "interpolated", k), e).leaves()
                for k, e in enumerate(out_shape[2:])]
    table = self.table("interpolate",
                       [[Axis(s) for s in d] for d in out_dims]
                       + [[Axis(a.size.root()) for a in d] for d in leaves[2:]], details)
    sizes = [[a.size.root() for a in d] for d in leaves[:2]] + out_dims
    labels = self.out_labels(sizes)
    inner = [[self.label() for _ in d] for d in leaves[2:]]
    coeff, base = self.scaled(value)
    del spatial
    return self.emit(sizes, labels, [(coeff, [
        self.operand(base, labels[:2] + inner),
        self.operand(table, labels[2:] + inner)])])
