"""Lowering: groups of index-form assignments to backend-neutral statements.

Each term of an assignment becomes one einsum. With more than two operands the
contraction order is computed by opt_einsum (at the nominal sizes of DESIGN.md §7) and
emitted as a chain of pairwise einsums, so the generated code needs no optimiser of its
own. Deltas left between free indices select a diagonal of the output (an index
broadcast), and free indices that a term does not carry are broadcast; neither builds an
identity matrix. Elementwise functions are evaluated once per function and shared.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import opt_einsum
import sympy as sp

from ..derivations import sizes
from ..derivations.graph import Assign, Graph
from ..derivations.indexform import Apply, Index, Ref, Term
from ..derivations.model import Derivation
from . import ir

B = sp.Symbol("B", positive=True, integer=True)
NOMINAL = {B: 32, sizes.L: 16, sizes.d: 16, sizes.d_k: 16, sizes.d_ff: 64, sizes.h: 2,
           sizes.d_v: 8}
LETTERS = [c for c in string.ascii_letters if c != "b"]


@dataclass
class Function:
    """One generated function: reads ``reads`` from the namespace, runs ``statements``,
    stores ``writes``."""

    group: str
    requires: tuple[str, ...]
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    dims: list[str] = field(default_factory=list)
    statements: list = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def live_assigns(der: Derivation) -> list[Assign]:
    """The assignments some output, loss or guard needs (dead ones dropped)."""
    graph = der.graph
    needed = {t.name for t in graph.tensors.values() if t.role == "output"}
    needed |= {der.output.name, der.loss.name}
    needed |= {name for guard in der.guards for name in (guard.tensor, guard.scale)}
    live = []
    for assign in reversed(graph.assigns):
        if assign.target.name in needed:
            live.append(assign)
            needed |= assign.expr.names()
    return live[::-1]


class _Lowerer:
    def __init__(self, graph: Graph, function: Function,
                 applied_nodes: dict[tuple, str]) -> None:
        self.graph = graph
        self.applied_nodes = applied_nodes
        self.function = function
        self.temps: dict[tuple, str] = {}
        self.used: dict[str, None] = {}
        self.current = ""
        self.count = 0
        self.dims: set[sp.Symbol] = set()

    def temp(self) -> str:
        self.count += 1
        return f"_t{self.count}"

    def operand(self, factor: Ref | Apply) -> str:
        if isinstance(factor, Ref):
            return self.use(factor.name)
        key = (factor.fn.key, factor.name)
        node = self.applied_nodes.get(key)
        if node is not None and node != self.current:  # a node defined as this function
            return self.use(node)
        if key not in self.temps:
            self.use(factor.name)
            label = factor.fn.label.replace("'", "_d")
            name = f"_{label}_{factor.name}"
            self.temps[key] = name
            self.function.statements.append(
                ir.Elementwise(name, factor.fn.expr, sp.Symbol("x", real=True), factor.name))
        return self.temps[key]

    def use(self, name: str) -> str:
        self.used.setdefault(name, None)
        return name

    def coefficient(self, coeff: sp.Expr) -> sp.Expr:
        self.dims |= {s for s in coeff.free_symbols}
        return coeff

    def assign(self, assign: Assign) -> None:
        target = assign.target
        self.current = target.name
        if assign.reduction == "causal":
            size = target.indices[0].dim
            self.dims.add(size)
            self.function.statements.append(ir.CausalBias(target.name, size))
            return
        if assign.reduction == "max":
            source = self.use(assign.expr.terms[0].factors[0].name)
            self.function.statements.append(ir.RowMax(target.name, source))
            return
        shape = ((B,) if target.batched else ()) + target.shape
        terms = assign.expr.terms
        if len(terms) == 1 and self._direct(assign, terms[0]):
            value, coeff, _ = self.term(assign, terms[0], result=target.name)
            if value != target.name or coeff != 1:
                self.function.statements.append(
                    ir.Assign(target.name, value, self.coefficient(coeff)))
            return
        self.dims |= set(shape)
        self.function.statements.append(ir.Zeros(target.name, shape))
        for term in terms:
            value, coeff, (tie, broadcast) = self.term(assign, term)
            self.function.statements.append(
                ir.Accumulate(target.name, tie, value, self.coefficient(coeff), broadcast))

    def _direct(self, assign: Assign, term: Term) -> bool:
        present = {i for f in term.data_factors for i in f.indices}
        value_batched = self.graph.term_is_batched(term)
        return (not term.deltas and set(assign.target.indices) <= present
                and value_batched == assign.target.batched)

    def term(self, assign: Assign, term: Term, result: str | None = None):
        """Lower one term: the value's name (None for a constant), its coefficient, and how
        it lands in the target (tie spec, broadcast pattern)."""
        target = assign.target
        free = target.indices
        rep = {i: i for i in free}

        def find(i: Index) -> Index:
            while rep[i] != i:
                i = rep[i]
            return i

        order = {i: n for n, i in enumerate(free)}
        for delta in term.deltas:
            a, b = sorted((find(delta.a), find(delta.b)), key=order.__getitem__)
            rep[b] = a
        rep = {i: find(i) for i in free}
        view = [i for i in free if rep[i] == i]
        factors = [f.renamed(rep) for f in term.data_factors]
        letters: dict[Index, str] = {}
        for index in [*view, *(i for f in factors for i in f.indices)]:
            letters.setdefault(index, LETTERS[len(letters)])
        batched_value = self.graph.term_is_batched(term)
        coeff = term.coeff
        if assign.mean_over_batch and batched_value:
            coeff = coeff / B
        present = [i for i in view if any(i in f.indices for f in factors)]
        value = None
        if factors:
            keep_batch = batched_value and target.batched
            out = ("b" if keep_batch else "") + "".join(letters[i] for i in present)
            operands = []
            for f in factors:
                batched = self.graph.tensors[f.name].batched
                spec = ("b" if batched else "") + "".join(letters[i] for i in f.indices)
                operands.append((self.operand(f), spec))
            value = self.contract(operands, out, result if term.coeff == 1 else None)
        tie = None
        if len(view) < len(free):
            prefix = "b" if target.batched else ""
            tie = (prefix + "".join(letters[rep[i]] for i in free) + "->"
                   + prefix + "".join(letters[i] for i in view))
        broadcast = None
        if value is not None and len(present) < len(view):
            lead = (True,) if batched_value and target.batched else ()
            broadcast = lead + tuple(i in present for i in view)
        return value, coeff, (tie, broadcast)

    def contract(self, operands: list[tuple[str, str]], out: str,
                 result: str | None = None) -> str:
        """A chain of pairwise einsums in the order opt_einsum computes; the last one is
        stored as ``result`` when given."""
        if len(operands) == 1 and operands[0][1] == out:
            return operands[0][0]
        specs = [s for _, s in operands]
        if len(operands) > 2:
            dims = {}
            for name, spec in operands:
                tensor_dims = self._dims_of(name, spec)
                dims.update(zip(spec, tensor_dims))
            shapes = [tuple(NOMINAL.get(dims[c], 16) for c in s) for s in specs]
            path, _ = opt_einsum.contract_path(",".join(specs) + "->" + out, *shapes,
                                               shapes=True, optimize="auto-hq")
        else:
            path = [tuple(range(len(operands)))]
        pending = list(operands)
        for step in path:
            chosen = [pending[k] for k in step]
            pending = [p for k, p in enumerate(pending) if k not in step]
            if pending:
                later = set(out) | {c for _, s in pending for c in s}
                result_spec = "".join(dict.fromkeys(
                    c for _, s in chosen for c in s if c in later))
            else:
                result_spec = out
            name = result if result and not pending else self.temp()
            spec = ",".join(s for _, s in chosen) + "->" + result_spec
            self.function.statements.append(
                ir.Contract(name, spec, tuple(n for n, _ in chosen)))
            pending.append((name, result_spec))
        return pending[0][0]

    def _dims_of(self, name: str, spec: str) -> list[sp.Symbol]:
        tensor = self.graph.tensors.get(name)
        if tensor is None:  # an elementwise temporary: the shape of its argument
            source = next(n for (k, n), t in self.temps.items() if t == name)
            tensor = self.graph.tensors[source]
        dims = ([B] if tensor.batched else []) + list(tensor.shape)
        return dims[-len(spec):] if spec else []


def lower(der: Derivation) -> list[Function]:
    """One :class:`Function` per group, in dependency order."""
    live = live_assigns(der)
    applied_nodes = {}
    for assign in live:
        terms = assign.expr.terms
        if (assign.group == "forward" and len(terms) == 1 and terms[0].coeff == 1
                and len(terms[0].factors) == 1 and isinstance(terms[0].factors[0], Apply)
                and terms[0].factors[0].indices == assign.target.indices):
            factor = terms[0].factors[0]
            applied_nodes[(factor.fn.key, factor.name)] = assign.target.name
    functions = []
    for name, group in der.groups.items():
        function = Function(name, group.requires)
        lowerer = _Lowerer(der.graph, function, applied_nodes)
        assigns = [a for a in live if a.group == name]
        written = [a.target.name for a in assigns]
        guards = {guard.tensor: guard for guard in der.guards}
        for assign in assigns:
            lowerer.assign(assign)
            guard = guards.get(assign.target.name)
            if guard is not None:
                function.statements.append(
                    ir.Guard(guard.tensor, guard.scale, guard.argument, guard.message))
        function.reads = [n for n in lowerer.used if n not in written]
        function.writes = written
        function.dims = sorted(str(s) for s in lowerer.dims if s in NOMINAL)
        functions.append(function)
    return functions
