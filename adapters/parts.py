"""A model's graph cut into the parts a chain composes: its repeated blocks (the items of a
``ModuleList`` such as ``layers.3``) and what comes before and after them, each a graph of
its own with one tensor in and one out.

Equal blocks read into equal programs (their parameters named relative to the block, their
operations numbered within it), so a model of any depth derives one module per distinct part.
Where one tensor does not carry everything from a part to the next (a value computed in
block 0 and read in block 5), the parts are merged: the model is then read in larger pieces,
never approximated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .records import Source

_BLOCK = re.compile(r"^(.*\.)?\d+$")


@dataclass
class NodeRun:
    """A run of the graph's differentiable nodes: the block path they belong to (``""``:
    outside every block), and the nodes."""

    path: str
    nodes: list[torch.fx.Node]


def _block_of(node: torch.fx.Node) -> str:
    """The outermost item of a module list among the submodules a node comes from."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if _BLOCK.match(path) and not path.startswith("_empty"):
            return path
    return ""


def cut(graph: torch.fx.Graph, differentiable: set[str], X: str, params: dict[str, str],
        output: torch.fx.Node, batch_dim: int = 0) -> list[Source]:
    """The graph's differentiable nodes in parts (see the module docstring), each as a
    :class:`Source`; one part when the graph has no blocks."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.name in differentiable]
    parts: list[NodeRun] = []
    for node in nodes:
        block = _block_of(node)
        if parts and parts[-1].path == block:
            parts[-1].nodes.append(node)
        else:
            parts.append(NodeRun(block, [node]))
    parts = _merged(parts, X, params, output)
    return [_source(graph, part, k, parts, X, params, output, batch_dim)
            for k, part in enumerate(parts)]


def _inputs(part: NodeRun, X: str, params: dict[str, str]) -> set[str]:
    """The differentiable values a part reads from outside itself (parameters aside)."""
    own = {n.name for n in part.nodes}
    return {arg.name for node in part.nodes for arg in node.all_input_nodes
            if arg.name not in own and (arg.name == X or arg.op == "call_function")
            and arg.name not in params}


def _merged(parts: list[NodeRun], X: str, params: dict[str, str],
            output: torch.fx.Node) -> list[NodeRun]:
    """``parts`` with neighbours merged until each reads one tensor from the one before (the
    first reads ``X``), has parameters, and the last makes the output."""
    differentiable = {n.name for part in parts for n in part.nodes} | {X}

    def valid(k: int, parts: list[NodeRun]) -> bool:
        part = parts[k]
        inputs = {n for n in _inputs(part, X, params) if n in differentiable}
        expected = X if k == 0 else parts[k - 1].nodes[-1].name
        uses_params = any(arg.name in params for node in part.nodes
                          for arg in node.all_input_nodes)
        later = {n.name for p in parts[k + 1:] for n in p.nodes}
        own = {n.name for n in part.nodes}
        # what later parts read of this part: its last node only
        leaked = {arg.name for p in parts[k + 1:] for node in p.nodes
                  for arg in node.all_input_nodes if arg.name in own}
        last_ok = leaked <= {part.nodes[-1].name} and (k < len(parts) - 1
                                                       or part.nodes[-1] is output)
        return inputs <= {expected} and uses_params and last_ok and not (
            k == len(parts) - 1 and later)

    changed = True
    while changed and len(parts) > 1:
        changed = False
        for k in range(len(parts)):
            if not valid(k, parts):
                j = k - 1 if k > 0 else k + 1  # merge into the part before (or after)
                a, b = sorted((j, k))
                parts = (parts[:a] + [NodeRun(parts[a].path if parts[a].path == parts[b].path
                                           else "", parts[a].nodes + parts[b].nodes)]
                         + parts[b + 1:])
                changed = True
                break
    return parts


def _source(graph: torch.fx.Graph, part: NodeRun, k: int, parts: list[NodeRun], X: str,
            params: dict[str, str], output: torch.fx.Node, batch_dim: int) -> Source:
    """One part as a graph of its own: its input (``X`` or the previous part's output) and
    what it reads besides (parameters, constants) as placeholders, its last node the
    output."""
    if len(parts) == 1:
        return Source(graph, params, X, output, "", batch_dim)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    own = {n.name for n in part.nodes}
    source_name = X if k == 0 else parts[k - 1].nodes[-1].name
    prefix = part.path + "." if part.path else ""
    part_params = {}
    outside = []
    for node in part.nodes:
        for arg in node.all_input_nodes:
            if arg.name not in own and arg not in outside:
                outside.append(arg)
    position = {node: k for k, node in enumerate(graph.nodes)}
    outside.sort(key=position.get)  # parameters in the module's order
    for arg in outside:
        placeholder = sub.placeholder(arg.name)  # fx may rename it (``input`` → ``input_1``)
        placeholder.meta = dict(arg.meta)
        env[arg] = placeholder
        if arg.name in params:
            part_params[placeholder.name] = params[arg.name].removeprefix(prefix)
    for node in part.nodes:
        env[node] = sub.node_copy(node, lambda n: env[n])
    last = env[part.nodes[-1]]
    sub.output((last,))
    original = next(n for n in graph.nodes if n.name == source_name)
    if original in env:
        input_name = env[original].name
    else:  # a part that ignores its input
        with sub.inserting_before(next(iter(sub.nodes))):
            placeholder = sub.placeholder(source_name)
        placeholder.meta = dict(original.meta)
        input_name = placeholder.name
    return Source(sub, part_params, input_name, last, part.path,
                  _batch_dim(graph, source_name, X, batch_dim))


def _batch_dim(graph: torch.fx.Graph, name: str, X: str, batch_dim: int) -> int:
    """Where the batch lies in a part's input: ``X``'s own, or for an inner part the
    dimension of its input that has ``X``'s batch size (symbol)."""
    if name == X or batch_dim == 0:
        return batch_dim
    nodes = {n.name: n for n in graph.nodes}
    batch = nodes[X].meta["val"].shape[batch_dim]
    shape = nodes[name].meta["val"].shape
    matches = [k for k, e in enumerate(shape) if str(e) == str(batch)]
    return matches[0] if len(matches) == 1 else batch_dim
