"""Rules of elementwise arithmetic: an elementwise function of one tensor is fused into one
SymPy expression (``Value.expr``: an activation, a shifted reciprocal square root), sums and
products with broadcasting become einsums, ``where`` and ``masked_fill`` a sum of branches
under 0/1 masks made at call time (a fill value exactly as it is, ``finfo.min`` too)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import sympy as sp
import torch

from ...derivations.functions import sigmoid, softplus, x
from ..axes import Axis
from ..builder import Builder
from ..records import Value, _number
from .registry import RULES, rule

aten = torch.ops.aten


def _unary(reader: Builder, source, fn: Callable[[sp.Expr], sp.Expr]) -> Value:
    value = reader.value(source)
    return Value(value.dims, value.tensor, value.axes, fn(value.expr), value.constant,
                 value.transform, (reader.node.name, reader.what(), reader.where()))


def _same_tensor(reader: Builder, a: Value, b: Value) -> bool:
    """Whether ``a`` and ``b`` read one tensor the same way (so an elementwise operation
    of the two is a function of that tensor)."""
    return (a.tensor is not None and a.tensor == b.tensor and len(a.dims) == len(b.dims)
            and all([id(x_) for x_ in da] == [id(y_) for y_ in db]
                    for da, db in zip(reader.leaf_dims(a), reader.leaf_dims(b))))


def _binary(reader: Builder, node, a, b, op: str, alpha=1) -> object:
    """``a op b`` for ``op`` in ``+ - * /`` (``alpha`` scaling ``b`` of a sum)."""
    numbers = {k: v for k, v in (("a", a), ("b", b)) if not isinstance(v, torch.fx.Node)}
    if numbers:
        try:
            number = _number(numbers.get("a", numbers.get("b")))
        except (TypeError, ValueError):
            raise reader.refuse(f"a finite number, got {numbers}") from None
        value = reader.value(b if "a" in numbers else a)
        fn = {"+": lambda e: e + alpha * number if "a" not in numbers else number + alpha * e,
              "-": lambda e: e - alpha * number if "a" not in numbers else number - alpha * e,
              "*": lambda e: e * number,
              "/": lambda e: e / number if "a" not in numbers else number / e}[op]
        return Value(value.dims, value.tensor, value.axes, fn(value.expr), value.constant,
                     value.transform, (node.name, reader.what(), reader.where()))
    first, second = reader.value(a), reader.value(b)
    if _same_tensor(reader, first, second):
        fa, fb = first.expr, second.expr
        expr = {"+": fa + alpha * fb, "-": fa - alpha * fb, "*": fa * fb, "/": fa / fb}[op]
        return Value(first.dims, first.tensor, first.axes, expr,
                     origin=(node.name, reader.what(), reader.where()))
    alpha = _number(alpha)
    if op in "+-":
        sign = alpha if op == "+" else -alpha
        ca, va = reader.scaled(first)
        cb, vb = reader.scaled(second)
        return reader.combine([va, vb], [(ca, [0]), (sign * cb, [1])])
    if op == "/":
        second = Value(second.dims, second.tensor, second.axes, 1 / second.expr,
                       second.constant, second.transform)
    ca, va = reader.scaled(first)
    cb, vb = reader.scaled(second)
    return reader.combine([va, vb], [(ca * cb, [0, 1])])


@rule(aten.add.Tensor, aten.add.Scalar)
def read_add(reader: Builder, node, a, b, alpha=1) -> Value:
    return _binary(reader, node, a, b, "+", alpha)


@rule(aten.sub.Tensor, aten.sub.Scalar)
def read_sub(reader: Builder, node, a, b, alpha=1) -> Value:
    return _binary(reader, node, a, b, "-", alpha)


@rule(aten.rsub.Scalar, aten.rsub.Tensor)
def read_rsub(reader: Builder, node, a, b, alpha=1) -> Value:
    return _binary(reader, node, b, a, "-", alpha)


@rule(aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
       aten.add_.Scalar, aten.sub_.Scalar, aten.mul_.Scalar, aten.div_.Scalar)
def read_in_place(reader: Builder, node, a, *args, **kwargs) -> Value:
    """``a.op_(b)`` as ``a op b``, ``a`` read as its result from then on: where nothing
    read ``a`` before (no view of it can see the change)."""
    order = {n: k for k, n in enumerate(reader.graph.nodes)}
    if not isinstance(a, torch.fx.Node) or a.op == "placeholder" or any(
            order[user] < order[node] for user in a.users if user is not node):
        raise reader.refuse("an in-place operation on a tensor nothing read before")
    name = str(node.target._overloadpacket).removeprefix("aten.").rstrip("_")
    result = RULES[getattr(aten, name).Tensor](reader, node, a, *args, **kwargs)
    reader.values[a.name] = result
    return result


@rule(aten.mul.Tensor, aten.mul.Scalar, operator.mul)
def read_mul(reader: Builder, node, a, b) -> Value:
    return _binary(reader, node, a, b, "*")


@rule(aten.div.Tensor, aten.div.Scalar)
def read_div(reader: Builder, node, a, b) -> Value:
    return _binary(reader, node, a, b, "/")


@rule(aten.neg.default)
def read_neg(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: -e)


@rule(aten.pow.Tensor_Scalar)
def read_pow(reader: Builder, node, source, exponent) -> Value:
    return _unary(reader, source, lambda e: e ** _number(exponent))


@rule(aten.square.default)
def read_square(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: e ** 2)


@rule(aten.rsqrt.default)
def read_rsqrt(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: e ** sp.Rational(-1, 2))


@rule(aten.sqrt.default)
def read_sqrt(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.sqrt)


@rule(aten.reciprocal.default)
def read_reciprocal(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: 1 / e)


@rule(aten.exp.default)
def read_exp(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.exp)


@rule(aten.log.default)
def read_log(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.log)


@rule(aten.tanh.default)
def read_tanh(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.tanh)


@rule(aten.sigmoid.default)
def read_sigmoid(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sigmoid)


@rule(aten.erf.default)
def read_erf(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.erf)


@rule(aten.sin.default)
def read_sin(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.sin)


@rule(aten.cos.default)
def read_cos(reader: Builder, node, source) -> Value:
    return _unary(reader, source, sp.cos)


@rule(aten.relu.default)
def read_relu(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: sp.Max(e, 0))


@rule(aten.silu.default)
def read_silu(reader: Builder, node, source) -> Value:
    return _unary(reader, source, lambda e: e * sigmoid(e))


@rule(aten.gelu.default)
def read_gelu(reader: Builder, node, source, approximate="none") -> Value:
    if approximate == "tanh":
        return _unary(reader, source, lambda e: e * (1 + sp.tanh(
            sp.sqrt(2 / sp.pi) * (e + sp.Rational(44715, 1000000) * e ** 3))) / 2)
    return _unary(reader, source, lambda e: e * (1 + sp.erf(e / sp.sqrt(2))) / 2)


@rule(aten.softplus.default)
def read_softplus(reader: Builder, node, source, beta=1, threshold=20) -> Value:
    beta = _number(beta)
    return _unary(reader, source, lambda e: softplus(beta * e) / beta)


@rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def read_where(reader: Builder, node, condition, a, b) -> Value:
    """``where(m, a, b)`` as ``a·m + b·(1 - m)``, each product with its own 0/1 mask (exact:
    ``a + b - b`` would lose ``a`` beside ``b = finfo.min``); a branch that is a constant
    (a fill value, a tensor of them) is made at call time with the mask, as torch does,
    so that no derivative flows where the forward took it."""
    mask = reader.value(condition)
    if mask.constant is None:
        raise reader.refuse("a condition that does not depend on X or the parameters")
    branches, made = [], []
    for arg, taken in ((a, "float"), (b, "not")):
        if not isinstance(arg, torch.fx.Node):
            made.append(_filled(reader, mask, arg, "fill" if taken == "float" else "fill_not"))
            continue
        value = reader.value(arg)
        if value.tensor is None and value.expr == x and value.transform == "same":
            made.append(_made(reader, [mask, value], "then" if taken == "float" else "else"))
        else:
            branches.append((value, Value(mask.dims, constant=mask.constant,
                                          transform=taken)))
    values = [v for pair in branches for v in pair] + made
    terms = [(1, [2 * k, 2 * k + 1]) for k in range(len(branches))]
    terms += [(1, [2 * len(branches) + k]) for k in range(len(made))]
    return reader.combine(values, terms)


def _filled(reader: Builder, mask: Value, fill: object, transform: str) -> Value:
    """The number ``fill`` where ``mask`` is true (``fill_not``: false), 0 elsewhere."""
    if not isinstance(fill, int | float) or math.isnan(fill):
        raise reader.refuse(f"a number to fill with, got {fill!r}")
    return Value(mask.dims, constant=mask.constant, transform=f"{transform}:{float(fill)!r}")


def _made(reader: Builder, values: list[Value], transform: str) -> Value:
    """A constant made at call time from the values of the constants ``values`` (each the
    value of its node) by ``transform``; its dimensions are theirs, broadcast."""
    sizes, _ = reader.broadcast(values)
    return Value([[Axis(size) for size in dim] for dim in sizes],
                 constant=tuple(v.constant for v in values), transform=transform)


@rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def read_masked_fill(reader: Builder, node, source, mask, fill) -> Value:
    """``x·(1 - m) + c·m`` with ``c·m`` made at call time: the filled entries have no
    derivative, as in torch. An infinite fill is added (``x - inf`` is ``-inf`` where
    ``x·0 - inf`` would be too, but a second mask's ``-inf·0`` would not)."""
    value, where = reader.value(source), reader.value(mask)
    if where.constant is None:
        raise reader.refuse("a mask that does not depend on X or the parameters")
    if isinstance(fill, torch.fx.Node):
        filler = reader.value(fill)
        if filler.tensor is not None or filler.expr != x or filler.transform != "same":
            raise reader.refuse("a fill value that does not depend on X or the parameters")
        filled = _made(reader, [where, filler], "then")
    else:
        filled = _filled(reader, where, fill, "fill")
    coeff, base = reader.scaled(value)
    if isinstance(fill, float) and math.isinf(fill):
        return reader.combine([base, filled], [(coeff, [0]), (1, [1])])
    kept = Value(where.dims, constant=where.constant, transform="not")
    return reader.combine([base, kept, filled], [(coeff, [0, 1]), (1, [2])])
