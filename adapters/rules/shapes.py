"""Rules of shapes: views and reshapes (the same tensor read with other dimensions, no
operation), transposes, ``expand``; selections (slices, index picks, splits, ``unbind``) as a
multiplication by a 0/1 table ``S[out, in]``; concatenations and stacks as sums of placed
pieces; ``repeat`` as a broadcast (each repeated dimension factored into ``(copies,
entries)``); constant ``pad`` as a placement plus the fill on the entries it adds."""

from __future__ import annotations

import sympy as sp
import torch

from ..axes import Axis, ShapeError, regroup
from ..builder import Builder
from ..records import EMPTY, Value, _number
from .registry import makes, rule

aten = torch.ops.aten


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
       aten.unflatten.int, aten.flatten.using_ints)
def read_view(reader: Builder, node, source, *args, **kwargs) -> Value:
    value = reader.value(source)
    leaves = [leaf for dim in reader.leaf_dims(value) for leaf in dim]
    dims = regroup(leaves, reader.shape_of(node))
    return Value(dims, value.tensor, value.axes, value.expr, value.constant,
                 value.transform)


@rule(aten.transpose.int)
def read_transpose(reader: Builder, node, source, a, b) -> Value:
    value = reader.value(source)
    dims = list(value.dims)
    dims[a], dims[b] = dims[b], dims[a]
    return reader.with_dims(value, dims)


@rule(aten.permute.default)
def read_permute(reader: Builder, node, source, order) -> Value:
    value = reader.value(source)
    return reader.with_dims(value, [value.dims[k] for k in order])


@rule(aten.t.default, aten.numpy_T.default)
def read_t(reader: Builder, node, source) -> Value:
    value = reader.value(source)
    return reader.with_dims(value, value.dims[::-1])


@rule(aten.unsqueeze.default)
def read_unsqueeze(reader: Builder, node, source, dim) -> Value:
    value = reader.value(source)
    dims = list(value.dims)
    dims.insert(dim if dim >= 0 else len(dims) + dim + 1, [])
    return reader.with_dims(value, dims)


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def read_squeeze(reader: Builder, node, source, dims=None) -> Value:
    value = reader.value(source)
    rank = len(value.dims)
    chosen = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
    dropped = {d % rank for d in chosen if not value.dims[d % rank]}
    return reader.with_dims(value, [d for k, d in enumerate(value.dims) if k not in dropped])


@rule(aten.expand.default, aten.broadcast_to.default)
def read_expand(reader: Builder, node, source, shape, *args) -> Value:
    value = reader.value(source)
    out = reader.shape_of(node)
    dims = [[] for _ in range(len(out) - len(value.dims))] + list(value.dims)
    for k, extent in enumerate(out):
        if not dims[k] and extent != 1:
            dims[k] = [Axis(reader.size((node.name, k), extent))]
    return reader.with_dims(value, dims)


@rule(aten.contiguous.default, aten.clone.default, aten.alias.default,
       aten.lift_fresh_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
       aten._to_copy.default, aten.type_as.default, aten.detach_.default)
def read_same(reader: Builder, node, source, *args, **kwargs) -> Value:
    wide, narrow = source.meta["val"].dtype, node.meta["val"].dtype
    if (not reader.narrowing and wide.is_floating_point and narrow.is_floating_point
            and torch.finfo(narrow).max < torch.finfo(wide).max):
        users = ", ".join(sorted({str(u.target).split(".")[-2].lstrip("_")
                                  for u in node.users if u.op == "call_function"}))
        reader.narrowing = (f"{str(narrow).removeprefix('torch.')} (cast from "
                          f"{str(wide).removeprefix('torch.')}"
                          + (f" before {users})" if users else ")"))
    return reader.value(source)


@rule(aten.dropout.default, aten.native_dropout.default)
def read_dropout(reader: Builder, node, source, p, train) -> Value:
    if train and p > 0:
        raise reader.refuse(f"dropout off: the module is in training mode with p = {p} "
                          "(random); call module.eval() or set p = 0")
    return reader.value(source)


def _select(reader: Builder, key: str, value: Value, dim: int, details: tuple, out_extent) -> Value:
    """``value`` along ``dim`` multiplied by a selection table ``S[out, in]`` (the new
    tensor named after ``key``); a ``pick`` of one index drops the dimension."""
    dim = dim % len(value.dims)
    source = reader.leaf_dims(value)[dim]
    pick = details[0] == "pick"
    out_dim = [] if pick else reader.size((key, "selected"), out_extent).leaves()
    table = reader.table("select", [[Axis(s) for s in out_dim],
                                  [Axis(a.size.root()) for a in source]], details)
    sizes, labels, term = reader.through_table(value, dim, table, out_dim)
    terms = [term]
    if pick:  # the picked dimension is gone
        sizes, labels = sizes[:dim] + sizes[dim + 1:], labels[:dim] + labels[dim + 1:]
    return reader.emit(sizes, labels, terms, key)


def _chunk(reader: Builder, key: str, value: Value, dim: int, count: int, k: int) -> Value | None:
    """Chunk ``k`` of ``count`` equal ones along ``dim``: the dimension factored into
    ``(count, rest)`` and index ``k`` picked along the first factor (a one-hot vector of
    ``count`` entries, where a selection table would be a product over the whole
    dimension); None where the dimension's factors cannot be cut there."""
    total = sp.Mul(*[a.extent for a in reader.leaf_dims(value)[dim]])
    if count < 2 or not isinstance(total, int | sp.Integer) or int(total) % count:
        return None
    try:
        outer, _ = regroup(reader.leaf_dims(value)[dim], [count, int(total) // count])
    except ShapeError:
        return None
    full = reader.leaf_dims(value)[dim]
    outer, inner = full[:len(outer)], full[len(outer):]
    table = reader.table("select", [[], [Axis(a.size.root()) for a in outer]], ("pick", k))
    sizes = [[a.size.root() for a in d] for d in reader.leaf_dims(value)]
    sizes[dim] = [a.size.root() for a in inner]
    labels = reader.out_labels(sizes)
    picked = [reader.label() for _ in outer]
    value_labels = [list(d) for d in labels]
    value_labels[dim] = picked + labels[dim]
    coeff, base = reader.scaled(value)
    return reader.emit(sizes, labels, [(coeff, [reader.operand(base, value_labels),
                                              reader.operand(table, [[], picked])])], key)


@rule(aten.slice.Tensor)
def read_slice(reader: Builder, node, source, dim=0, start=None, end=None, step=1) -> Value:
    value = reader.value(source)
    dim = dim % len(value.dims)
    extent = reader.shape_of(node)[dim]
    if extent == 0:
        return EMPTY
    full = reader.leaf_dims(value)[dim]
    total = sp.Mul(*[a.extent for a in full]) if full else 1
    start, step = (reader.values[v.name] if isinstance(v, torch.fx.Node) else v
                   for v in (start or 0, step))
    if start == 0 and step == 1 and sp.simplify(extent - total) == 0:
        return value  # the whole dimension
    if not isinstance(total, int | sp.Integer) or not all(
            isinstance(v, int) for v in (start, step)):
        raise reader.refuse("a slice of fixed bounds along a dimension of fixed size")
    if step == 1 and isinstance(extent, int) and int(total) % extent == 0 and \
            start % extent == 0:  # one of equal chunks
        chunk = _chunk(reader, node.name, value, dim, int(total) // extent, start // extent)
        if chunk is not None:
            return chunk
    return _select(reader, node.name, value, dim, ("slice", int(start), int(step)), extent)


@rule(aten.select.int)
def read_select_int(reader: Builder, node, source, dim, index) -> Value:
    value = reader.value(source)
    full = reader.leaf_dims(value)[dim % len(value.dims)]
    total = sp.Mul(*[a.extent for a in full]) if full else 1
    if not isinstance(index, int) or not sp.sympify(total).is_Integer and index < 0:
        raise reader.refuse("an index of fixed value")
    return _select(reader, node.name, value, dim, ("pick", int(index)), 1)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def read_split(reader: Builder, node, source, sizes, dim=0) -> tuple:
    value = reader.value(source)
    dim = dim % len(value.dims)
    full = reader.leaf_dims(value)[dim]
    total = int(sp.Mul(*[a.extent for a in full]))
    if node.target is aten.chunk.default:
        step = -(-total // sizes)
        sizes = [min(step, total - k) for k in range(0, total, step)]
    elif isinstance(sizes, int):
        sizes = [min(sizes, total - k) for k in range(0, total, sizes)]
    if len(set(sizes)) == 1:  # equal chunks
        chunks = [_chunk(reader, f"{node.name}_{k}", value, dim, len(sizes), k)
                  for k in range(len(sizes))]
        if all(chunk is not None for chunk in chunks):
            return tuple(chunks)
    out, start = [], 0
    for k, extent in enumerate(sizes):
        out.append(_select(reader, f"{node.name}_{k}", value, dim, ("slice", start, 1),
                                extent))
        start += extent
    return tuple(out)


@rule(aten.unbind.int)
def read_unbind(reader: Builder, node, source, dim=0) -> tuple:
    value = reader.value(source)
    full = reader.leaf_dims(value)[dim % len(value.dims)]
    count = int(sp.Mul(*[a.extent for a in full])) if full else 1
    return tuple(_select(reader, f"{node.name}_{k}", value, dim, ("pick", k), 1)
                 for k in range(count))


@rule(aten.stack.default)
def read_stack(reader: Builder, node, sources, dim=0) -> Value:
    """``stack``: each input given a new dimension of one at ``dim``, then concatenated
    there."""
    values = [reader.value(s) for s in sources]
    at = dim % (len(values[0].dims) + 1)
    return _concatenated(reader, node, [reader.with_dims(v, v.dims[:at] + [[]] + v.dims[at:])
                                     for v in values], at)


def _zeros(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes a tensor of zeros (``torch.zeros``, ``new_zeros``, a fill
    with 0)."""
    if node.target in (aten.zeros.default, aten.new_zeros.default,
                       aten.zeros_like.default):
        return True
    fills = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
    at = fills.get(node.target)
    return at is not None and len(node.args) > at and node.args[at] == 0


@rule(aten.cat.default)
def read_cat(reader: Builder, node, sources, dim=0) -> Value:
    kept = [s for s in sources if reader.values.get(s.name) is not EMPTY
            and reader.shape_of(s) != [0]]  # torch.cat skips a 1-d empty tensor too
    values = [reader.value(s) for s in kept]
    if len(values) == 1:
        return values[0]
    zeros = {k for k, s in enumerate(kept) if _zeros(s) and s.name not in
             reader.differentiable}
    return _concatenated(reader, node, values, dim % len(values[0].dims), zeros)


def _concatenated(reader: Builder, node, values: list[Value], dim: int,
                  zeros: set[int] = frozenset()) -> Value:
    """``values`` placed one after another along ``dim`` (each by a constant placement
    table, counted from the end where a size bound at call time comes before it), every
    other dimension aligned as by broadcasting; the pieces ``zeros`` (constant zeros)
    only take their place."""
    out_extent = reader.shape_of(node)[dim]
    out_size = reader.size((node.name, "cat"), out_extent).leaves()
    others = [reader.with_dims(v, v.dims[:dim] + v.dims[dim + 1:])
              for k, v in enumerate(values) if k not in zeros]
    sizes, (labels, *per_value) = reader.broadcast(others)
    per_value = iter(per_value)
    out_label = [reader.label() for _ in out_size]
    out_sizes = sizes[:dim] + [out_size] + sizes[dim:]
    out_labels = labels[:dim] + [out_label] + labels[dim:]
    extents = [sp.Mul(*[a.extent for a in reader.leaf_dims(v)[dim]]) for v in values]
    terms = []
    for k, value in enumerate(values):
        if k in zeros:
            continue
        own = next(per_value)
        part = reader.leaf_dims(value)[dim]
        before, after = sum(extents[:k]), sum(extents[k + 1:])
        if sp.sympify(before).is_Integer:
            place = ("place", int(before))
        elif sp.sympify(after).is_Integer:  # placed from the end
            place = ("place_end", int(after))
        else:
            raise reader.refuse("a concatenation whose pieces have fixed sizes but one")
        inner = [reader.label() for _ in part]
        table = reader.table(place[0], [[Axis(s) for s in out_size],
                                      [Axis(a.size.root()) for a in part]], place)
        coeff, base = reader.scaled(value)
        terms.append((coeff, [reader.operand(base, own[:dim] + [inner] + own[dim:]),
                              reader.operand(table, [out_label, inner])]))
    return reader.emit(out_sizes, out_labels, terms)


@rule(aten.repeat.default)
def read_repeat(reader: Builder, node, source, repeats) -> Value:
    """``source.repeat(r…)``: dimension ``k`` of the result is ``(r_k, n_k)`` row-major, its
    entry independent of the copy: the copies a broadcast axis (leading new dimensions
    too)."""
    value = reader.computed(reader.value(source), "a repeat")
    out = reader.shape_of(node)
    before = reader.shape_of(source)
    extra = len(out) - len(before)
    dims = [[] for _ in range(extra)] + [list(d) for d in value.dims]
    leaves = [[] for _ in range(extra)] + reader.leaf_dims(value)
    for k, extent in enumerate(out):
        given = before[k - extra] if k >= extra else 1
        copies = sp.simplify(sp.sympify(extent) / given)
        if copies == 1:
            continue
        if any(reader.is_batch(a) for a in leaves[k]):
            raise reader.refuse("a repeat along the features, not along the batch")
        if dims[k] and not copies.is_Integer:
            raise reader.refuse("a repeat along a dimension of more than one entry by a count "
                              "fixed when the module is read (this one is bound at call "
                              f"time: {copies})")
        dims[k] = [Axis(reader.size((node.name, "copies", k), copies))] + dims[k]
    return reader.with_dims(value, dims)


@rule(aten.constant_pad_nd.default)
def read_constant_pad_nd(reader: Builder, node, source, pad, value=0) -> Value:
    return _padded(reader, node, source, pad, value)


@rule(aten.pad.default)
def read_pad(reader: Builder, node, source, pad, mode="constant", value=None) -> Value:
    if mode != "constant":
        raise reader.refuse(f"a pad in constant mode (mode = {mode!r} repeats or reflects the "
                          "tensor's own entries, which curvgap does not read)")
    return _padded(reader, node, source, pad, value)


def _padded(reader: Builder, node, source, pad, fill) -> Value:
    """``source`` padded by ``pad`` (pairs ``(before, after)`` from the last dimension on;
    negative: cut) with ``fill``: along each padded dimension the placement ``out[o] =
    in[o - before]`` plus ``fill`` on the entries the pad adds."""
    value = reader.computed(reader.value(source), "a pad")
    if any(not isinstance(p, int) for p in pad):
        raise reader.refuse("a pad of fixed widths")
    try:
        fill = _number(0 if fill is None else fill)
    except (TypeError, ValueError):
        raise reader.refuse(f"a finite fill value, got {fill!r}") from None
    out_shape = reader.shape_of(node)
    rank = len(value.dims)
    for j in range(len(pad) // 2):
        before, after = pad[2 * j], pad[2 * j + 1]
        if before or after:
            dim = rank - 1 - j
            value = _pad_dim(reader, node, value, dim, before, after, out_shape[dim], fill)
    return value


def _pad_dim(reader: Builder, node, value: Value, dim: int, before: int, after: int, extent,
             fill: sp.Expr) -> Value:
    leaves = reader.leaf_dims(value)
    part = leaves[dim]
    if any(reader.is_batch(a) for a in part):
        raise reader.refuse("a pad along the features, not along the batch")
    out_size = reader.size((node.name, "padded", dim), extent).leaves()
    shift = reader.table("shift", [[Axis(s) for s in out_size],
                                 [Axis(a.size.root()) for a in part]], ("shift", before))
    sizes, labels, term = reader.through_table(value, dim, shift, out_size)
    terms = [term]
    if fill != 0:
        border = reader.table("border", [[Axis(s) for s in out_size]],
                            ("border", max(before, 0), max(after, 0)))
        terms.append((fill, [reader.operand(border, [labels[dim]])]))
    return reader.emit(sizes, labels, terms, f"{node.name}_{dim}")


# -- the tables the shape rules record, made at call time ---------------------------------------
@makes("slice")
def make_slice(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """``S[o, i] = 1`` where ``i = start + step·o``."""
    start, step = args
    return torch.eye(sizes[1], **options)[start:start + step * sizes[0]:step]


@makes("pick")
def make_pick(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """Row ``index`` of the identity: the entry an index picks."""
    return torch.eye(sizes[1], **options)[args[0]]


@makes("place")
def make_place(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """``S[o, i] = 1`` where ``o = offset + i``: a piece placed in a concatenation."""
    (offset,) = args
    table = torch.zeros(sizes[0], sizes[1], **options)
    table[offset:offset + sizes[1]] = torch.eye(sizes[1], **options)
    return table


@makes("place_end")
def make_place_end(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """A piece placed ``after`` entries before the end."""
    (after,) = args
    table = torch.zeros(sizes[0], sizes[1], **options)
    table[sizes[0] - after - sizes[1]:sizes[0] - after] = torch.eye(sizes[1], **options)
    return table


@makes("shift")
def make_shift(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """``out[o] = in[o - offset]`` (a constant pad's placement)."""
    (offset,) = args
    rows = torch.arange(sizes[0], device=options["device"])[:, None]
    return (rows == torch.arange(sizes[1], device=options["device"]) + offset).to(
        options["dtype"])


@makes("border")
def make_border(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """1 on the first ``before`` and the last ``after`` entries (a pad's fill)."""
    before, after = args
    table = torch.zeros(sizes[0], **options)
    table[:before] = 1
    table[sizes[0] - after:] = 1
    return table
