"""Facts about the nodes of an exported graph: the submodule a node comes from, which nodes
carry a derivative (depend on ``X`` or a parameter through operations autograd
differentiates), which stop it (``detach``, ``torch.no_grad()``), side effects curvgap
refuses, and the refusal that names a node's operation and submodule."""

from __future__ import annotations

import re

import torch

from .records import UnsupportedOperation

aten = torch.ops.aten


def _path(node: torch.fx.Node) -> str:
    """The submodule a node comes from, as a dotted path (``layers.3.mlp.act_fn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return "" if path.startswith("_empty") else path


def _stops(node: torch.fx.Node) -> bool:
    """Whether autograd passes no derivative through ``node``: a ``detach`` (a
    straight-through estimator's ``x + (f(x) - x).detach()``), a ``torch.no_grad()``
    region."""
    return node.target in _CONSTANT_OUTPUT or (
        node.target is torch.ops.higher_order.wrap_with_set_grad_enabled
        and node.args[0] is False)


def refusal(node: torch.fx.Node | None, missing: str, root: str = "") -> UnsupportedOperation:
    """The error for ``node``: its operation, its submodule (else ``root``), what is
    missing."""
    where = (_path(node) if node is not None else "") or root
    if node is None:
        return UnsupportedOperation(f"{where or 'the module'}: curvgap needs {missing}")
    target = node.target
    name = (getattr(target, "__name__", None) or str(target)).removesuffix(".default")
    name = re.sub(r"^aten\.", "", str(getattr(target, "_overloadpacket", name)))
    return UnsupportedOperation(f"{where or 'the module'}: operation {name} "
                                f"(node {node.name}): curvgap needs {missing}")


def side_effects(graph: torch.fx.Graph) -> None:
    """Refuse an operation that changes a tensor in place and whose result nothing reads
    (``nn.Embedding(max_norm=...)`` rescales rows of its table at every call): the module's
    weights would then differ from call to call."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable \
                and not node.users:
            what = ("an embedding without max_norm (it rescales rows of its table in place at "
                    "every call)" if node.target is aten.embedding_renorm_.default else
                    "no operation that changes a tensor in place for its side effect")
            raise refusal(node, what)


#: operations whose result autograd does not differentiate: ``detach`` stops derivatives
#: (``x + (f(x) - x).detach()``), the others read only their input's shape
_CONSTANT_OUTPUT = {aten.detach.default, aten.zeros_like.default, aten.ones_like.default,
                    aten.full_like.default, aten.empty_like.default, aten.new_zeros.default,
                    aten.new_ones.default, aten.new_full.default, aten.new_empty.default}


def ancestors(node: torch.fx.Node) -> set[str]:
    """The names of ``node`` and of every node it is computed from."""
    seen: set[str] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current.name not in seen:
            seen.add(current.name)
            pending.extend(current.all_input_nodes)
    return seen


def differentiable(graph: torch.fx.Graph, sources: set[str]) -> set[str]:
    """The nodes of ``graph`` that depend on the placeholders ``sources`` (``X``, the
    parameters) through operations autograd differentiates and hold floating-point values:
    what carries a derivative. Every other node is a constant, made at call time."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in sources:
                out.add(node.name)
        elif node.op == "call_function" and not _stops(node) and any(
                arg.name in out for arg in node.all_input_nodes) and (
                _floating(node.meta.get("val")) or node.target in _VIEWS):
            out.add(node.name)  # a view of integer token ids too: an embedding reads it
    return out


def _floating(value: object) -> bool:
    """Whether a node's value is a floating-point tensor (or a tuple of them): what can carry
    a derivative."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, tuple | list):
        return any(_floating(v) for v in value)
    return False


#: operations that read a tensor another way (what token ids may go through to an embedding)
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.unflatten.int, aten.flatten.using_ints, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
          aten.contiguous.default, aten.clone.default, aten.alias.default, aten.to.device,
          aten._to_copy.default}

