"""The loss a model computes itself (``curvgap.curvature(model, loss="model")``), read from
its trace: the first output a ``F.cross_entropy`` (or ``F.mse_loss``) of its logits against a
target its own code makes from its inputs — a Hugging Face model given ``labels=`` shifts them
by one position, pads with ``-100`` and flattens. The program then ends at the logits, its
loss is that loss, and at each call the target is made by the module's code like any constant.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import sympy as sp
import torch

from .records import UnsupportedOperation

aten = torch.ops.aten

#: operations that change a tensor's shape, layout or dtype but none of its values
_SHAPE_ONLY = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.contiguous.default, aten.alias.default, aten.clone.default,
               aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
               aten.flatten.using_ints, aten.squeeze.default, aten.squeeze.dim,
               aten.squeeze.dims}

#: the losses read, with the arguments each may have as torch's defaults only
_LOSSES = {
    aten.cross_entropy_loss.default: ("cross_entropy", ("weight", "reduction", "ignore_index",
                                                        "label_smoothing"),
                                      (None, 1, -100, 0.0)),
    aten.mse_loss.default: ("mse", ("reduction",), (1,)),
}


@dataclass(frozen=True)
class OwnLoss:
    """The model's loss: ``kind`` (``"cross_entropy"``, ``"mse"``) of the logits against the
    graph node ``target``, whose entries lie along the logits' leading axes ``rows`` (sizes as
    the trace has them: an expression in its symbols where free)."""

    kind: str
    target: str
    rows: tuple


def is_loss(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a loss curvgap reads as the model's own."""
    return node.target in _LOSSES


def own_loss(node: torch.fx.Node, model: str) -> tuple[torch.fx.Node, OwnLoss]:
    """The logits ``node`` (the model's first output, ``model`` its name) is the loss of, and
    the loss; UnsupportedOperation naming what differs from a loss curvgap reads."""
    inner = next((n for n in node.all_input_nodes if n.target in _LOSSES), None)
    if node.target not in _LOSSES and inner is not None:
        raise UnsupportedOperation(
            f"loss='model': {model}'s loss is F.{_LOSSES[inner.target][0]} of its logits "
            f"then {getattr(node.target, '__name__', node.target)} (a sum over the batch "
            f"divided by num_items_in_batch?); curvgap reads the loss itself, torch's mean "
            f"over the targets counted: leave num_items_in_batch out")
    if node.target not in _LOSSES:
        raise UnsupportedOperation(
            f"loss='model': expected {model}'s first output to be its loss, F.cross_entropy or "
            f"F.mse_loss of its logits (a Hugging Face model gives it when called with "
            f"labels=...), got the result of {getattr(node.target, '__name__', node.target)}")
    kind, names, defaults = _LOSSES[node.target]
    logits, target, *given = node.args
    logits, target = _unbroadcast(logits), _unbroadcast(target)  # F.mse_loss broadcasts
    options = dict(zip(names, given)) | {k: v for k, v in node.kwargs.items() if k in names}
    for name, default in zip(names, defaults):
        value = options.get(name, default)
        if value != default:
            raise UnsupportedOperation(
                f"loss='model': {model}'s loss uses {name}={_said(name, value)}; curvgap reads "
                f"torch's default {_said(name, default)} (the mean over the targets counted"
                f"{', -100 ignored' if kind == 'cross_entropy' else ''}): leave "
                f"num_items_in_batch and class weights out, or pass loss='{kind}' with the "
                f"target")
    shape = tuple(logits.meta["val"].shape)
    entries = _size(shape)
    # the logits before the flattening and casts of the loss: the first tensor back along
    # them of as many entries, its last axis the classes (of a cross-entropy)
    chosen, at = None, logits
    while True:
        value = at.meta.get("val")
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and \
                _size(value.shape) == entries and (
                    kind != "cross_entropy" or _size(value.shape[-1:]) == _size(shape[-1:])):
            chosen = at
        if at.target not in _SHAPE_ONLY or not isinstance(at.args[0], torch.fx.Node):
            break
        at = at.args[0]
    if chosen is None or not isinstance(target, torch.fx.Node):
        raise UnsupportedOperation(f"loss='model': expected {model}'s loss to read logits of "
                                   f"shape (B, ..., classes), got shape {shape}")
    leading = tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s)
                    for s in chosen.meta["val"].shape)
    return chosen, OwnLoss(kind, target.name, leading[:-1] if kind == "cross_entropy"
                           else leading)


def _unbroadcast(node: object) -> object:
    """``node``, or where it is an operand of ``broadcast_tensors`` of its own shape (as
    ``F.mse_loss`` passes its operands), that operand itself."""
    if isinstance(node, torch.fx.Node) and node.target is operator.getitem and \
            getattr(node.args[0], "target", None) is aten.broadcast_tensors.default:
        operand = node.args[0].args[0][node.args[1]]
        if tuple(operand.meta["val"].shape) == tuple(node.meta["val"].shape):
            return operand
    return node


def _size(shape: tuple) -> sp.Expr:
    """The number of entries of ``shape`` (sizes the trace left free as its symbols)."""
    return sp.expand(sp.Mul(*(s.node.expr if isinstance(s, torch.SymInt) else sp.Integer(s)
                              for s in shape)))


def _said(name: str, value: object) -> str:
    return {"reduction": {0: "'none'", 1: "'mean'", 2: "'sum'"}}.get(name, {}).get(
        value, repr(value))


def target_of(own: OwnLoss, value: torch.Tensor, sizes: dict) -> torch.Tensor:
    """The target ``value`` the module made, laid out along the logits' rows (``sizes``: the
    value of each free size of the trace for this call)."""
    shape = tuple(int(sp.sympify(s).xreplace(sizes)) for s in own.rows)
    if value.numel() != math.prod(shape):
        raise ValueError(f"labels: the model makes a target of {value.numel()} entries from "
                         f"them, expected {math.prod(shape)} (its logits' rows {shape})")
    return value.reshape(shape)
