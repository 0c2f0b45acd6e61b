"""Lowering: groups of index-form assignments to backend-neutral statements.

Each term of an assignment becomes one einsum. With more than two operands the contraction
order is computed by opt_einsum (at the nominal sizes: a program's own, a config's
``NOMINAL``, the benchmark's headline size) and emitted as a chain of pairwise einsums, so
the generated code needs no optimiser of its own. Deltas left between free indices select a
diagonal of the output (an index broadcast), and free indices that a term does not carry are
broadcast; neither builds an identity matrix. Elementwise functions are evaluated once per
function and shared, and so is every pairwise product: the contraction order counts a
product the function already has as free. A node is made by its first full product (or as
one sum of arrays) and then accumulated into, and is laid out row-major. After lowering,
terms that share an operand are combined (distributivity) and temporaries are freed after
their last use. A parameter's gradient, Hessian- or Gauss–Newton-vector product made by a
matrix product is written straight into the caller's array for it, when the caller passes
one (a slice of the flat result it returns).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import string
from collections.abc import Callable
from dataclasses import dataclass, field

import opt_einsum
import sympy as sp

from ..derivations import sizes
from ..derivations.derivation import Derivation
from ..derivations.graph import Assign, Graph
from ..derivations.indexform import Apply, Index, Ref, Term
from ..derivations.program import Program
from . import ir

B = sizes.B
NOMINAL = {B: 32, sizes.L: 16, sizes.d: 16, sizes.d_k: 16, sizes.d_ff: 64, sizes.h: 2,
           sizes.d_v: 8, sizes.g: 1, sizes.r: 2, sizes.d_r: 8, sizes.n_2: 2, sizes.n_r: 4,
           sizes.n_u: 8, sizes.p: 16, sizes.c: 10, sizes.n_1: 1, sizes.R: 4, sizes.L_m: 16}
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
    def __init__(self, graph: Graph, function: Function, applied_nodes: dict[tuple, str],
                 nominal: dict[sp.Symbol, int]) -> None:
        self.graph = graph
        self.nominal = nominal
        self.applied_nodes = applied_nodes
        self.function = function
        self.temps: dict[tuple, str] = {}
        self.contractions: dict[tuple, str] = {}
        self.computed_pairs: set[tuple[str, ...]] = set()  # operands of the contractions
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
        if assign.reduction == "rotary":
            length, chunks, _, half = (k.dim for k in target.indices)
            self.dims |= {length, chunks, half}
            self.function.statements.append(ir.Rotary(target.name, length, chunks, half,
                                                      assign.base, assign.scaling))
            return
        if assign.reduction == "relative":
            length, _, buckets = (k.dim for k in target.indices)
            self.dims |= {length, buckets}
            self.function.statements.append(ir.RelativeBuckets(target.name, length, buckets,
                                                               *assign.relative))
            return
        if assign.reduction in ("rows_mean", "rows_first", "rows_rest"):
            length = target.indices[1].dim
            self.dims.add(length)
            self.function.statements.append(
                ir.RowWeights(target.name, length, assign.reduction.removeprefix("rows_")))
            return
        if assign.reduction == "max":
            source = self.use(assign.expr.terms[0].factors[0].name)
            self.function.statements.append(ir.RowMax(target.name, source))
            return
        shape = ((B,) if target.batched else ()) + target.shape
        terms = assign.expr.terms
        if len(terms) == 1 and self._direct(assign, terms[0]):
            value, coeff, _ = self.term(assign, terms[0], result=target.name)
            if value == target.name and coeff != 1:  # the product there is scaled next:
                self._forget(target.name)            # no later term may share it
            if value == target.name and coeff != 1 and self._fresh_product(target.name):
                # a product just made (a batch mean's 1/B): scaled in place, not copied
                self.function.statements.append(ir.Scale(target.name,
                                                         self.coefficient(coeff)))
            elif value != target.name or coeff != 1:
                self.function.statements.append(
                    ir.Assign(target.name, value, self.coefficient(coeff)))
            return
        self.dims |= set(shape)
        if self._combine(assign):
            return
        # a full product first: it can then make the array (see make_arrays_from_products)
        terms = sorted(terms, key=lambda t: not (len(t.data_factors) > 1
                                                 and self._direct(assign, t)))
        self.function.statements.append(ir.Zeros(target.name, shape))
        for term in terms:
            value, coeff, (tie, broadcast) = self.term(assign, term)
            self.function.statements.append(
                ir.Accumulate(target.name, tie, value, self.coefficient(coeff), broadcast))

    def _forget(self, name: str) -> None:
        """Share no product stored as ``name`` from now on (it is about to be scaled)."""
        self.contractions = {k: v for k, v in self.contractions.items() if v != name}

    def _fresh_product(self, name: str) -> bool:
        """Whether the last statement made ``name`` as a product of two arrays (a fresh
        array that nothing else holds)."""
        last = self.function.statements[-1] if self.function.statements else None
        return (isinstance(last, ir.Contract) and last.result == name
                and len(last.operands) == 2)

    def _combine(self, assign: Assign) -> bool:
        """Lower a sum of single arrays (some broadcast, none on a diagonal) as one
        :class:`ir.Combine`, when one of them has every axis; False if not."""
        terms = assign.expr.terms
        if len(terms) < 2 or any(t.deltas or len(t.data_factors) != 1 for t in terms):
            return False
        lowered = [(self.term(assign, t), self._direct(assign, t)) for t in terms]
        if any(tie is not None for (_, _, (tie, _)), _ in lowered) or not any(
                full for _, full in lowered):
            return False
        parts = [ir.Part(self.coefficient(coeff), value, None, broadcast)
                 for (value, coeff, (_, broadcast)), full in
                 sorted(lowered, key=lambda item: not item[1])]
        self.function.statements.append(ir.Combine(assign.target.name, tuple(parts)))
        return True

    def _direct(self, assign: Assign, term: Term) -> bool:
        present = {i for f in term.data_factors for i in f.indices}
        value_batched = self.graph.term_is_batched(term)
        # a batched value summed into an unbatched target (a batch mean) is full too
        return (not term.deltas and set(assign.target.indices) <= present
                and (value_batched == assign.target.batched or not assign.target.batched))

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
        """A chain of pairwise einsums in the order opt_einsum computes, where a product
        this function already computed counts as free; the last one is stored as
        ``result`` when given."""
        if len(operands) == 1 and operands[0][1] == out:
            return operands[0][0]
        pending = list(operands)
        sizes = {}
        for name, spec in operands:
            sizes.update(zip(spec, (self.nominal.get(d, 16) for d in self._dims_of(name, spec))))
        while True:
            step, reuse = self._next_step(pending, out, sizes)
            chosen = [pending[k] for k in step]
            pending = [p for k, p in enumerate(pending) if k not in step]
            result_spec = self._result_spec(chosen, pending, out)
            if reuse is not None:
                pending.append((reuse, result_spec))
                continue
            spec = ",".join(s for _, s in chosen) + "->" + result_spec
            key = (canonical_spec(spec), tuple(n for n, _ in chosen))
            name = self.contractions.get(key)  # the same product, computed before: shared
            if name is None:
                name = result if result and not pending else self.temp()
                self.function.statements.append(ir.Contract(name, spec, key[1]))
                self.contractions[key] = name
                self.computed_pairs.add(key[1])
            pending.append((name, result_spec))
            if len(pending) == 1:
                return name

    @staticmethod
    def _result_spec(chosen: list[tuple[str, str]], pending: list[tuple[str, str]],
                     out: str) -> str:
        if not pending:
            return out
        later = set(out) | {c for _, s in pending for c in s}
        return "".join(dict.fromkeys(c for _, s in chosen for c in s if c in later))

    def _next_step(self, pending: list[tuple[str, str]], out: str, sizes: dict[str, int]
                   ) -> tuple[tuple[int, ...], str | None]:
        """The operands to contract next, and the name of the product when this function
        has it already: reusing one wins when the rest then costs no more flops than the
        cheapest order from scratch."""
        if len(pending) <= 2:
            return tuple(range(len(pending))), None
        path, cost = _order(pending, out, sizes)
        for pair in itertools.permutations(range(len(pending)), 2):
            chosen = [pending[k] for k in pair]
            if (chosen[0][0], chosen[1][0]) not in self.computed_pairs:
                continue  # no product of these two operands computed yet
            rest = [p for k, p in enumerate(pending) if k not in pair]
            result_spec = self._result_spec(chosen, rest, out)
            spec = ",".join(s for _, s in chosen) + "->" + result_spec
            name = self.contractions.get((canonical_spec(spec), tuple(n for n, _ in chosen)))
            if name is not None and _order([*rest, (name, result_spec)], out, sizes)[1] <= cost:
                return pair, name
        return path[0], None

    def _dims_of(self, name: str, spec: str) -> list[sp.Symbol]:
        tensor = self.graph.tensors.get(name)
        if tensor is None:  # an elementwise temporary: the shape of its argument
            source = next(n for (k, n), t in self.temps.items() if t == name)
            tensor = self.graph.tensors[source]
        dims = ([B] if tensor.batched else []) + list(tensor.shape)
        return dims[-len(spec):] if spec else []


#: Intermediates may be this many times larger than the largest operand or result.
MEMORY_FACTOR = 16


def _order(pending: list[tuple[str, str]], out: str, sizes: dict[str, int]
           ) -> tuple[list[tuple], int]:
    """:func:`_path` for named operands, ``sizes`` the nominal size of each letter."""
    specs = [s for _, s in pending]
    # letters renamed in order of appearance: equal products share one search (cached)
    return _path(canonical_spec(",".join(specs) + "->" + out),
                 tuple(tuple(sizes[c] for c in s) for s in specs), tuple(sizes[c] for c in out))


@functools.cache
def _path(spec: str, shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...]
          ) -> tuple[list[tuple], int]:
    """opt_einsum's pairwise order of fewest flops among those whose intermediates stay within
    :data:`MEMORY_FACTOR` times the largest operand or result (an intermediate much larger than
    both costs memory traffic that flops do not count), and its flop count: by trying every
    order for up to four operands (fast), by dynamic programming for more."""
    largest = max(math.prod(s) for s in [*shapes, tuple(out_shape)])
    method = "optimal" if spec.count(",") < 4 else "dp"
    try:
        path, info = opt_einsum.contract_path(spec, *shapes, shapes=True, optimize=method,
                                              memory_limit=MEMORY_FACTOR * largest)
    except RuntimeError:  # dynamic programming found no order within the limit
        path = [(0, 1, 2)]
    if any(len(step) > 2 for step in path):  # the limit left no pairwise order
        path, info = opt_einsum.contract_path(spec, *shapes, shapes=True, optimize="auto-hq")
    return path, int(info.opt_cost)


def canonical_spec(spec: str) -> str:
    """``spec`` with its letters renamed in order of appearance: equal for equal products."""
    names: dict[str, str] = {}
    return "".join(c if c in ",->" else names.setdefault(c, LETTERS[len(names)])
                   for c in spec)


def _reads(statement) -> tuple[str, ...]:
    if isinstance(statement, ir.Contract):
        return statement.operands
    if isinstance(statement, ir.Combine):
        return tuple(part.value for part in statement.parts)
    if isinstance(statement, (ir.Accumulate, ir.Assign)):
        return (statement.value,) if statement.value else ()
    if isinstance(statement, ir.Elementwise):
        return (statement.argument,)
    if isinstance(statement, ir.RowMax):
        return (statement.source,)
    if isinstance(statement, ir.Guard):
        return (statement.tensor, statement.scale)
    return ()


@dataclass(frozen=True)
class _Option:
    """One way to factor an accumulation: ``group`` says which others it combines with
    (target, view, spec, the shared operand and its position), ``spec`` is the contraction
    with ``Q``'s axes in a fixed order, ``permute`` brings ``Q`` into that order."""

    group: tuple
    spec: str
    permute: str | None


def factor_shared_operands(statements: list, fresh: Callable[[], str]) -> list:
    """Distributivity: accumulations ``target += c_k · einsum(spec, P, Q_k)`` that share
    the operand ``P`` and the spec become ``target += einsum(spec, P, Σ_k c_k Q_k)``, one
    (often the most expensive) contraction instead of one per term."""
    contracts = {s.result: s for s in statements if isinstance(s, ir.Contract)}
    uses: dict[str, int] = {}
    for statement in statements:
        for name in _reads(statement):
            uses[name] = uses.get(name, 0) + 1
    options: dict[int, list[_Option]] = {}
    for position, statement in enumerate(statements):
        contract = contracts.get(getattr(statement, "value", None))
        if (not isinstance(statement, ir.Accumulate) or contract is None
                or len(contract.operands) != 2 or uses[contract.result] != 1):
            continue
        inputs, out = contract.spec.split("->")
        specs = inputs.split(",")
        options[position] = []
        for k in (0, 1):
            shared, other = specs[k], specs[1 - k]
            if set(other) <= set(shared) | set(out):  # every Q_k of one shape
                # Q_k's axes in a fixed order, so that transposed terms combine too
                ordered = "".join(sorted(other, key=(shared + out).index))
                spec = f"{shared},{ordered}->{out}" if k == 0 else f"{ordered},{shared}->{out}"
                group = (statement.target, statement.tie, statement.broadcast,
                         canonical_spec(spec), k, contract.operands[k])
                options[position].append(
                    _Option(group, spec, None if ordered == other else f"{other}->{ordered}"))
    sizes: dict[tuple, int] = {}
    for choices in options.values():
        for option in choices:
            sizes[option.group] = sizes.get(option.group, 0) + 1
    members: dict[tuple, list[tuple[int, _Option]]] = {}
    for position, choices in options.items():
        best = max(choices, key=lambda option: sizes[option.group], default=None)
        if best is not None and sizes[best.group] > 1:
            members.setdefault(best.group, []).append((position, best))
    dropped: set[int] = set()
    inserted: dict[int, list] = {}
    for (target, tie, broadcast, _, k, shared), group in members.items():
        if len(group) < 2:
            continue
        terms = []
        for position, option in group:
            accumulate = statements[position]
            contract = contracts[accumulate.value]
            terms.append(ir.Part(accumulate.coeff, contract.operands[1 - k], option.permute))
            dropped |= {position, statements.index(contract)}
        combined, product = fresh(), fresh()
        operands = (shared, combined) if k == 0 else (combined, shared)
        inserted[group[-1][0]] = [
            ir.Combine(combined, tuple(terms)), ir.Contract(product, group[0][1].spec, operands),
            ir.Accumulate(target, tie, product, sp.Integer(1), broadcast)]
    out = []
    for position, statement in enumerate(statements):
        if position not in dropped:
            out.append(statement)
        out.extend(inserted.get(position, []))
    return out


def make_arrays_from_products(statements: list, keep: set[str]) -> list:
    """A node's zeros followed by a first accumulation of a full product (a fresh array
    that nothing else reads, not a node of ``keep``) become that product, scaled in place:
    no zeros to add to, and no second array of the node's size. So does a node assigned
    as a multiple of such a product."""
    contracts = {s.result: position for position, s in enumerate(statements)
                 if isinstance(s, ir.Contract)}
    uses: dict[str, int] = {}
    for statement in statements:
        for name in _reads(statement):
            uses[name] = uses.get(name, 0) + 1
    out = list(statements)
    zeros: dict[str, int] = {}
    for position, statement in enumerate(statements):
        if isinstance(statement, ir.Zeros):
            zeros[statement.result] = position
            continue
        if isinstance(statement, ir.Assign) and statement.value in contracts:
            source = contracts[statement.value]
            if (source < position and uses[statement.value] == 1
                    and statement.value not in keep
                    and len(statements[source].operands) == 2):
                out[source] = dataclasses.replace(statements[source], result=statement.result)
                out[position] = (None if statement.coeff == 1
                                 else ir.Scale(statement.result, statement.coeff))
            continue
        if not isinstance(statement, ir.Accumulate) or statement.target not in zeros:
            continue
        start = zeros.pop(statement.target)
        source = contracts.get(statement.value)
        if (source is None or statement.tie or statement.broadcast or uses[statement.value] > 1
                or statement.value in keep):
            continue
        contract = statements[source]
        if (len(contract.operands) != 2
                or len(contract.spec.split("->")[1]) != len(statements[start].shape)):
            continue
        out[start] = out[position] = None
        out[source] = dataclasses.replace(contract, result=statement.target)
        if statement.coeff != 1:
            out[position] = ir.Scale(statement.target, statement.coeff)
    return [statement for statement in out if statement is not None]


def lay_out_nodes_row_major(statements: list, nodes: set[str]) -> list:
    """The statements that make a node (not a constant) mark it row-major: arrays computed
    from a transposed node follow its strides, and reshapes of it copy."""
    def makes_node(statement) -> bool:
        return (isinstance(statement, (ir.Contract, ir.Combine, ir.Assign))
                and statement.result in nodes and getattr(statement, "value", "") is not None)
    return [dataclasses.replace(s, row_major=True) if makes_node(s) else s for s in statements]


def write_results_into_callers_arrays(statements: list, results: set[str]) -> list:
    """The matrix products that make one of ``results`` (a parameter's gradient or product)
    marked to write it into the caller's array for it (:attr:`ir.Contract.into`)."""
    return [dataclasses.replace(s, into=True)
            if isinstance(s, ir.Contract) and s.result in results else s for s in statements]


def free_temporaries(statements: list, keep: set[str]) -> list:
    """``statements`` with each temporary (not in ``keep``) deleted after its last use."""
    last: dict[str, int] = {}
    for position, statement in enumerate(statements):
        for name in _reads(statement):
            last[name] = position
    temporaries = {getattr(s, "result", None) for s in statements} - keep - {None}
    out = []
    for position, statement in enumerate(statements):
        out.append(statement)
        done = tuple(n for n in _reads(statement)
                     if n in temporaries and last[n] == position)
        if done:
            out.append(ir.Free(tuple(dict.fromkeys(done))))
    return out


def nominal_sizes(der: Derivation) -> dict[sp.Symbol, int]:
    """The sizes contraction orders are chosen for: a program's own (its sequence length
    taken as 128, the rows of a diagonal on rows as :data:`NOMINAL`'s), or a config's
    :data:`NOMINAL`."""
    if not isinstance(der.config, Program):
        return NOMINAL
    return {B: 8, sizes.R: NOMINAL[sizes.R],
            **{symbol: dict(der.config.sizes)[name] or 128
               for name, symbol in der.config.dims().items()}}


def lower(der: Derivation) -> list[Function]:
    """One :class:`Function` per group, in dependency order."""
    nominal = nominal_sizes(der)
    live = live_assigns(der)
    applied_nodes = {}
    for assign in live:
        terms = assign.expr.terms
        if (assign.group == "forward" and len(terms) == 1 and terms[0].coeff == 1
                and len(terms[0].factors) == 1 and isinstance(terms[0].factors[0], Apply)
                and terms[0].factors[0].indices == assign.target.indices):
            factor = terms[0].factors[0]
            applied_nodes[(factor.fn.key, factor.name)] = assign.target.name
    results = {node for kind in ("gradient", "hvp_joint", "gnvp_joint")
               for wrt, node in der.nodes(kind).items() if wrt != "X"}
    functions = []
    for name, group in der.groups.items():
        function = Function(name, group.requires)
        lowerer = _Lowerer(der.graph, function, applied_nodes, nominal)
        assigns = [a for a in live if a.group == name]
        written = [a.target.name for a in assigns]
        guards = {guard.tensor: guard for guard in der.guards}
        for assign in assigns:
            lowerer.assign(assign)
            if assign.target.name in guards:  # a statement of its own, after its node
                function.statements.append(guards[assign.target.name])
        statements = write_results_into_callers_arrays(make_arrays_from_products(
            factor_shared_operands(function.statements, lowerer.temp), set(written)), results)
        function.statements = free_temporaries(
            lay_out_nodes_row_major(statements, set(written)), set(written))
        function.reads = [n for n in lowerer.used if n not in written]
        function.writes = written
        function.dims = sorted(str(s) for s in lowerer.dims if s in nominal)
        functions.append(function)
    return functions
