"""Rules of linear maps: ``linear``, ``addmm``, ``matmul`` / ``bmm``, patch ``conv2d``
(a stride equal to the kernel: a linear map of patches), ``baddbmm`` (``β input + α batch1 @
batch2``) and ``einsum``: each one einsum of the program."""

from __future__ import annotations

import sympy as sp
import torch

from ...derivations.functions import x
from ..axes import align, regroup
from ..builder import Builder
from ..records import Value, _number
from .registry import rule

aten = torch.ops.aten


def _linear(reader: Builder, node, source, weight, bias, transposed: bool) -> Value:
    """``source W^T + b`` (``W`` of shape ``(out, in)``; ``(in, out)`` when
    ``transposed``)."""
    x_value, w_value = reader.value(source), reader.value(weight)
    if len(w_value.dims) != 2:
        raise reader.refuse("a weight matrix of two dimensions")
    w_in, w_out = (1, 0) if not transposed else (0, 1)
    x_leaves = reader.leaf_dims(x_value)
    align([a.size for a in x_leaves[-1]], [a.size for a in reader.leaf_dims(w_value)[w_in]])
    x_leaves = reader.leaf_dims(x_value)
    w_leaves = reader.leaf_dims(w_value)
    sizes = [[a.size.root() for a in d] for d in x_leaves[:-1]]
    out = [a.size.root() for a in w_leaves[w_out]]
    labels = reader.out_labels(sizes + [out])
    inner = [reader.label() for _ in x_leaves[-1]]
    w_labels = [labels[-1], inner] if not transposed else [inner, labels[-1]]
    cx, vx = reader.scaled(x_value)
    terms = [(cx, [reader.operand(vx, labels[:-1] + [inner]), reader.operand(w_value, w_labels)])]
    if bias is not None:
        b_value = reader.value(bias)
        if len(b_value.dims) != 1:
            raise reader.refuse("a bias of one dimension")
        align([a.size for a in reader.leaf_dims(b_value)[0]], out)
        terms.append((sp.Integer(1), [reader.operand(b_value, [labels[-1]])]))
    return reader.emit(sizes + [out], labels, terms)


@rule(aten.linear.default)
def read_linear(reader: Builder, node, source, weight, bias=None) -> Value:
    return _linear(reader, node, source, weight, bias, transposed=False)


@rule(aten.addmm.default)
def read_addmm(reader: Builder, node, bias, source, weight, beta=1, alpha=1) -> Value:
    if beta != 1 or alpha != 1:
        raise reader.refuse("addmm with beta = alpha = 1")
    return _linear(reader, node, source, weight, bias, transposed=True)


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def read_matmul(reader: Builder, node, a, b) -> Value:
    first, second = reader.value(a), reader.value(b)
    if len(first.dims) < 2 or len(second.dims) < 2:
        raise reader.refuse("matrix products of tensors with two or more dimensions")
    # batch dimensions broadcast; the last of a meets the second-to-last of b
    fa = reader.with_dims(first, first.dims[:-2])
    fb = reader.with_dims(second, second.dims[:-2])
    align([s.size for s in reader.leaf_dims(first)[-1]],
          [s.size for s in reader.leaf_dims(second)[-2]])
    batch_sizes, (batch_labels, la, lb) = reader.broadcast([fa, fb])
    rows = [a_.size.root() for a_ in reader.leaf_dims(first)[-2]]
    cols = [a_.size.root() for a_ in reader.leaf_dims(second)[-1]]
    inner = [reader.label() for _ in reader.leaf_dims(first)[-1]]
    out_sizes = batch_sizes + [rows, cols]
    out_labels = batch_labels + reader.out_labels([rows, cols])
    ca, va = reader.scaled(first)
    cb, vb = reader.scaled(second)
    return reader.emit(out_sizes, out_labels, [(ca * cb, [
        reader.operand(va, la + [out_labels[-2], inner]),
        reader.operand(vb, lb + [inner, out_labels[-1]])])])


@rule(aten.conv2d.default, aten.convolution.default)
def read_conv2d(reader: Builder, node, source, weight, bias=None, stride=(1, 1), padding=(0, 0),
                 dilation=(1, 1), groups=1, *rest) -> Value:
    x_value, w_value = reader.value(source), reader.value(weight)
    kernel = [int(e) for e in reader.shape_of(weight)[2:]]
    stride = list(stride) if isinstance(stride, list | tuple) else [stride] * 2
    padding = list(padding) if isinstance(padding, list | tuple) else [padding] * 2
    if (len(x_value.dims) != 4 or stride != kernel or any(padding) or groups != 1
            or any(d != 1 for d in dilation)):
        raise reader.refuse("a convolution that cuts images into patches (kernel = stride, "
                          "no padding, no dilation, one group)")
    out_shape = reader.shape_of(node)
    # split each image axis into (patches, kernel)
    image = [regroup(reader.leaf_dims(x_value)[k], [out_shape[k], kernel[k - 2]])
             for k in (2, 3)]  # each image axis as (patches, kernel)
    leaves = reader.leaf_dims(x_value)
    w_leaves = reader.leaf_dims(w_value)
    align([a.size for a in leaves[1]], [a.size for a in w_leaves[1]])
    align([image[0][1][0].size], [a.size for a in w_leaves[2]])
    align([image[1][1][0].size], [a.size for a in w_leaves[3]])
    leaves = reader.leaf_dims(x_value)
    w_leaves = reader.leaf_dims(w_value)
    batch = [a.size.root() for a in leaves[0]]
    channels_out = [a.size.root() for a in w_leaves[0]]
    patches = [[a.size.root() for a in g[0]] for g in image]
    out_sizes = [batch, channels_out, *patches]
    labels = reader.out_labels(out_sizes)
    c = [reader.label() for _ in leaves[1]]
    kh, kw = reader.label(), reader.label()
    x_labels = [labels[0], c, labels[2] + [kh], labels[3] + [kw]]
    terms = [(sp.Integer(1), [reader.operand(x_value, x_labels),
                              reader.operand(w_value, [labels[1], c, [kh], [kw]])])]
    if bias is not None:
        terms.append((sp.Integer(1), [reader.operand(reader.value(bias), [labels[1]])]))
    return reader.emit(out_sizes, labels, terms)


@rule(aten.baddbmm.default)
def read_baddbmm(reader: Builder, node, source, batch1, batch2, beta=1, alpha=1) -> Value:
    """``β source + α batch1 @ batch2`` (``source`` ignored where ``β = 0``, as torch does)."""
    product = read_matmul(reader, node, batch1, batch2)
    beta, alpha = _number(beta), _number(alpha)
    cp, vp = reader.scaled(product)
    if beta == 0:
        return Value(vp.dims, vp.tensor, vp.axes, alpha * cp * x,
                     origin=(node.name, reader.what(), reader.where()))
    cs, vs = reader.scaled(reader.value(source))
    return reader.combine([vs, vp], [(beta * cs, [0]), (alpha * cp, [1])], node.name)


@rule(aten.einsum.default)
def read_einsum(reader: Builder, node, equation, operands, path=None) -> Value:
    """``torch.einsum(equation, *operands)``: one einsum of the program (a letter's
    dimensions aligned across operands; a dimension of one broadcast)."""
    values = [reader.value(t) for t in operands]
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    specs = lhs.split(",")
    if len(specs) != len(values):
        raise reader.refuse("an einsum equation with one subscript per operand")
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
        raise reader.refuse("an einsum equation with one letter per dimension of each operand")
    if any(len(set(s)) != len(s) for s in subscripts):
        raise reader.refuse("an einsum without a letter repeated within one operand (a "
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
        full = [reader.leaf_dims(v)[s.index(letter)] for s, v in zip(subscripts, values)
                if letter in s and reader.leaf_dims(v)[s.index(letter)]]
        for other in full[1:]:
            align([a.size for a in full[0]], [a.size for a in other])
    sizes = {}
    for letter in order:
        full = [reader.leaf_dims(v)[s.index(letter)] for s, v in zip(subscripts, values)
                if letter in s and reader.leaf_dims(v)[s.index(letter)]]
        sizes[letter] = [a.size.root() for a in full[0]] if full else []
    summed = [letter for letter in order if letter not in out]
    if any(size is reader.batch.root() for letter in summed for size in sizes[letter]):
        raise reader.refuse("an einsum that sums over the features of each sample, not over "
                          "the batch")
    out_sizes = [sizes[letter] for letter in out]
    labels = dict(zip(out, reader.out_labels(out_sizes)))
    labels.update({letter: [reader.label() for _ in sizes[letter]] for letter in summed})
    coeff, factors = sp.Integer(1), []
    for s, v in zip(subscripts, values):
        c, base = reader.scaled(v)
        coeff *= c
        factors.append(reader.operand(base, [labels[letter] if dim else []
                                           for letter, dim in zip(s, reader.leaf_dims(v))]))
    return reader.emit(out_sizes, [labels[letter] for letter in out], [(coeff, factors)])
