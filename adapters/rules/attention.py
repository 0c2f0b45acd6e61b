"""Rules of attention and normalisation: ``softmax`` (the engine's primitive), ``layer_norm``
and ``rms_norm`` written as a centred (or not) reciprocal square root of a mean of squares,
and ``scaled_dot_product_attention`` written out: scores, masks (constant, or computed from
the parameters as T5's relative bias), a causal table, grouped queries, a row with every key
masked attending to nothing (torch's safe softmax); and the causal table's maker."""

from __future__ import annotations

import sympy as sp
import torch

from ...derivations.functions import x
from ..axes import Axis, align
from ..builder import Builder, Pending
from ..nodes import _path
from ..records import Value, _number, _symbol
from .registry import makes, rule

aten = torch.ops.aten


def softmax(reader: Builder, value: Value, dim: int, hint: str) -> Value:
    """The engine's softmax of ``value`` over ``dim`` (one axis)."""
    rank = len(value.dims)
    dim %= rank
    leaves = reader.leaf_dims(value)
    if len(leaves[dim]) != 1:
        raise reader.refuse("a softmax over one axis")
    order = [k for k in range(rank) if k != dim] + [dim]
    wanted = [a for k in order for a in leaves[k] if not reader.is_batch(a)]
    if (value.tensor is None or value.expr != x or [id(a) for a in wanted]
            != [id(a) for a in reader.axes_of(value.tensor)]):
        sizes = [[a.size.root() for a in leaves[k]] for k in order]
        labels = reader.out_labels(sizes)
        value_labels: list = [None] * rank
        for position, k in enumerate(order):
            value_labels[k] = labels[position]
        coeff, base = reader.scaled(value)
        copied = reader.emit(sizes, labels, [(coeff, [reader.operand(base, value_labels)])],
                           f"{hint}_scores")
        dims: list = [None] * rank
        for position, k in enumerate(order):
            dims[k] = copied.dims[position]
        value = Value(dims, copied.tensor, copied.axes)
    source = reader.axes_of(value.tensor)
    labels = [reader.label() for _ in source]
    name = reader.name(hint)
    axes = [Axis(a.size.root()) for a in source]
    reader.ops.append(Pending("softmax", name, labels,
                              list(zip(labels, [a.size.root() for a in source])),
                              "softmax", reader.where(), source=(value.tensor, labels)))
    reader._tensor_axes[name] = axes
    mapping = {id(s): a for s, a in zip(source, axes)}
    dims = [[mapping.get(id(a), a) for a in dim] for dim in reader.leaf_dims(value)]
    batch = [a for dim in dims for a in dim if reader.is_batch(a)]
    return Value(dims, name, batch[:1] + axes)


@rule(aten.softmax.int, aten._softmax.default)
def read_softmax(reader: Builder, node, source, dim, *rest, **kwargs) -> Value:
    value = reader.value(source)
    if not reader.leaf_dims(value)[dim % len(value.dims)]:  # over one entry: 1, a constant
        return Value(value.dims, constant=node.name)
    return softmax(reader, value, dim, node.name)


def _normalise(reader: Builder, node, source, count: int, eps: float, centred: bool,
               weight=None, bias=None, offset: float = 0) -> Value:
    """``(x - mean) / sqrt(var + eps)`` (or ``x / sqrt(mean(x²) + eps)``) over the last
    ``count`` dimensions, times ``weight + offset``, plus ``bias``."""
    value = reader.value(source)
    leaves = reader.leaf_dims(value)
    sizes = [[a.size.root() for a in d] for d in leaves]
    rows, features = sizes[:-count], sizes[-count:]
    if any(reader.is_batch(a) for d in leaves[-count:] for a in d):
        raise reader.refuse("a normalisation over the features of each sample")
    row_labels = reader.out_labels(rows)
    feature_labels = [[reader.label() for _ in d] for d in features]
    every = row_labels + feature_labels
    n = sp.Mul(*[_symbol(s) for d in features for s in d])
    coeff, base = reader.scaled(value)
    name = node.name
    if centred:
        mean = reader.emit(rows, row_labels, [(coeff / n, [reader.operand(base, every)])],
                         f"{name}_mean")
        spread_of = reader.emit(sizes, every, [(coeff, [reader.operand(base, every)]),
                                             (-1, [reader.operand(mean, row_labels)])],
                              f"{name}_centred")
        spread_coeff = sp.Integer(1)
    else:
        spread_of, spread_coeff = base, coeff
    spread = reader.emit(rows, row_labels, [(spread_coeff ** 2 / n, [
        reader.operand(spread_of, every), reader.operand(spread_of, every)])],
        f"{name}_var" if centred else f"{name}_meansquare")
    eps = _number(eps)
    if eps == 0:
        reader.guards.append((spread.tensor, mean.tensor if centred else spread.tensor,
                            f"{'LayerNorm' if centred else 'RMSNorm'} at "
                            f"{_path(node) or 'the module'} has eps = 0 and needs every "
                            "row variance > 0, but a row of its input is constant; "
                            "change the input or use eps > 0"))
    rsqrt = Value(spread.dims, spread.tensor, spread.axes, (x + eps) ** sp.Rational(-1, 2),
                  origin=(f"{name}_rsqrt", "rsqrt", reader.where()))
    terms = [(spread_coeff, [reader.operand(spread_of, every),
                             reader.operand(rsqrt, row_labels)])]
    normalised = reader.emit(sizes, every, terms, f"{name}_normalised"
                           if weight is not None else name)
    if weight is None:
        return normalised
    w = reader.value(weight)
    out_terms = [(sp.Integer(1), [reader.operand(w, feature_labels),
                                  reader.operand(normalised, every)])]
    if offset:
        out_terms.append((_number(offset), [reader.operand(normalised, every)]))
    if bias is not None:
        out_terms.append((sp.Integer(1), [reader.operand(reader.value(bias), feature_labels)]))
    return reader.emit(sizes, every, out_terms, name)


@rule(aten.layer_norm.default)
def read_layer_norm(reader: Builder, node, source, shape, weight=None, bias=None, eps=1e-5,
                     *rest) -> Value:
    return _normalise(reader, node, source, len(shape), eps, True, weight, bias)


@rule(aten.rms_norm.default)
def read_rms_norm(reader: Builder, node, source, shape, weight=None, eps=None) -> Value:
    if eps is None:
        eps = torch.finfo(node.args[0].meta["val"].dtype).eps
    return _normalise(reader, node, source, len(shape), eps, False, weight)


@rule(aten.scaled_dot_product_attention.default)
def read_sdpa(reader: Builder, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
               scale=None, enable_gqa=False) -> Value:
    if dropout_p:
        raise reader.refuse(f"attention dropout off (dropout_p = {dropout_p}: training "
                          "mode?); call module.eval()")
    Q, K, V = reader.value(q), reader.value(k), reader.value(v)
    if len(Q.dims) < 2 or len(K.dims) != len(Q.dims) or len(V.dims) != len(Q.dims):
        raise reader.refuse("queries, keys and values of equal rank")
    if enable_gqa and len(Q.dims) >= 3:
        qh, kh = reader.leaf_dims(Q)[-3], reader.leaf_dims(K)[-3]
        ratio = (int(sp.Mul(*[a.extent for a in qh]))
                 // int(sp.Mul(*[a.extent for a in kh])))
        if ratio > 1:  # query head (kv head, member of its group)
            shared = reader.size((node.name, "gqa"), ratio)
            align([a.size for a in qh], [a.size for a in kh] + [shared])
            K = reader.with_dims(K, K.dims[:-3] + [K.dims[-3] + [Axis(shared)]]
                                + K.dims[-2:])
            V = reader.with_dims(V, V.dims[:-3] + [V.dims[-3] + [Axis(shared)]]
                                + V.dims[-2:])
    align([a.size for a in reader.leaf_dims(Q)[-1]], [a.size for a in reader.leaf_dims(K)[-1]])
    align([a.size for a in reader.leaf_dims(K)[-2]], [a.size for a in reader.leaf_dims(V)[-2]])
    batch_sizes, (batch_labels, lq, lk, lv) = reader.broadcast(
        [reader.with_dims(t, t.dims[:-2]) for t in (Q, K, V)])
    query, key = reader.leaf_dims(Q)[-2], reader.leaf_dims(K)[-2]
    width, value_width = reader.leaf_dims(Q)[-1], reader.leaf_dims(V)[-1]
    for leaves, hint in ((width, "d_k"), (value_width, "d_v")):
        for a in leaves:
            reader.hints.setdefault(a.size.root(), hint)
    for dim in batch_sizes[-1:]:
        for size, hint in zip(dim, ("h",) if len(dim) == 1 else ("g", "r")):
            reader.hints.setdefault(size.root(), hint)
    i = reader.out_labels([[a.size.root() for a in query]])[0]
    j = reader.out_labels([[a.size.root() for a in key]])[0]
    e = [reader.label() for _ in width]
    f = reader.out_labels([[a.size.root() for a in value_width]])[0]
    if scale is None:
        scale = 1 / sp.sqrt(sp.Mul(*[_symbol(a.size) for a in width]))
    else:
        scale = _number(scale)
    # one key (a sequence of length 1): its softmax weight is 1 (0 where a mask drops it)
    single = not key
    cq, vq = reader.scaled(Q)
    ck, vk = reader.scaled(K)
    score_sizes = batch_sizes + [[a.size.root() for a in query], [a.size.root() for a in key]]
    scores = None if single else reader.emit(score_sizes, batch_labels + [i, j], [(
        scale * cq * ck, [reader.operand(vq, lq + [i, e]), reader.operand(vk, lk + [j, e])])],
        f"{node.name}_scores")
    kept = None
    if attn_mask is not None and reader.value(attn_mask).constant is None:
        # a mask computed from the parameters (a relative-position bias): a term of the
        # scores like any other
        if not single:
            cm, vm = reader.scaled(reader.value(attn_mask))
            scores = reader.combine([scores, vm], [(1, [0]), (cm, [1])],
                                  f"{node.name}_biased")
    elif attn_mask is not None:
        mask = reader.value(attn_mask)
        # a row with every key masked attends to nothing (torch's safe softmax): its
        # mask is zero and its output multiplied by 0
        boolean = attn_mask.meta["val"].dtype == torch.bool
        kept = Value(mask.dims[:-1] + [[]], constant=mask.constant,
                     transform="rows_kept" if boolean else "rows_finite")
        mask = Value(mask.dims, constant=mask.constant,
                     transform="additive_keep" if boolean else "additive_safe")
        if not single:
            scores = reader.combine([scores, mask], [(1, [0]), (1, [1])],
                                  f"{node.name}_masked")
    if is_causal and not single:
        leaves = reader.leaf_dims(scores)
        causal = reader.table("causal", [[Axis(a.size.root()) for a in leaves[-2]],
                                       [Axis(a.size.root()) for a in leaves[-1]]], ())
        scores = reader.combine([scores, causal], [(1, [0]), (1, [1])], f"{node.name}_causal")
    weights = None if single else softmax(reader, scores, -1, f"{node.name}_weights")
    # (one key: Q's batch dimensions stand in for the weights' in the broadcast)
    factors = [reader.with_dims(Q, Q.dims[:-2] + [[], []]) if single else weights, V] + (
        [kept] if kept is not None else [])
    sizes, (labels, *batch_labels) = reader.broadcast(
        [reader.with_dims(t, t.dims[:-2]) for t in factors])
    rows = reader.out_labels([[a.size.root() for a in query]])[0]
    keys = [reader.label() for _ in key]
    cv, vv = reader.scaled(V)
    out_sizes = sizes + [[a.size.root() for a in query], [a.size.root() for a in value_width]]
    operands = ([] if single else [reader.operand(weights, batch_labels[0] + [rows, keys])]
                ) + [reader.operand(vv, batch_labels[1] + [keys, f])]
    if kept is not None:
        query_dim = rows if reader.leaf_dims(kept)[-2] else []  # a mask broadcast over rows
        operands.append(reader.operand(kept, batch_labels[2] + [query_dim, []]))
    return reader.emit(out_sizes, labels + [rows, f], [(cv, operands)], node.name)


@makes("causal")
def make_causal(args: tuple, sizes: list[int], options: dict) -> torch.Tensor:
    """0 on and below the diagonal, ``-inf`` above it."""
    rows, columns = sizes
    above = torch.ones(rows, columns, dtype=torch.bool, device=options["device"]).triu(1)
    return torch.zeros(rows, columns, **options).masked_fill(above, float("-inf"))
