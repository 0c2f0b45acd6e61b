"""First and second derivatives of index-form graphs: the product and chain rules.

Everything here follows from two facts about index form:

* the derivative of a factor ``m[idx]`` is the tangent of ``m`` read at ``idx``
  (for a variable, a product of deltas), and of ``f(m)[idx]`` it is ``f'(m)[idx]`` times
  that tangent; the product rule sums over the factors of a term;
* the chain rule over a graph is forward propagation of tangents (Jacobians), backward
  propagation of adjoints (gradients), and, for second derivatives, the
  *second-order local part* of each node (the product rule applied to two distinct
  factors, or ``f''`` for an elementwise function) contracted either with second
  tangents (output Hessians) or with adjoints (loss Hessians: the second-order adjoint
  method, which never forms an output Hessian).

A node may instead carry closed-form local rules (``Assign.rule``, a primitive such as the
row softmax of :mod:`.softmax`): its tangents, second tangents, adjoints and loss-Hessian
part are then the rule's, written so that no floating-point cancellation is left for the
generated code to suffer.

A :class:`Tangents` object is the set of tangents of many tensors in one direction; its
``indices`` are the direction's indices (the entries of the variable, or none for a
Hessian-vector product).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from .graph import Graph, Tensor
from .indexform import Apply, Delta, Expr, Index, Ref, Term


@dataclass
class Tangents:
    """Tangents ``d tensor / d direction``: ``by_name[m]`` has free indices
    ``m.indices + indices``."""

    indices: tuple[Index, ...]
    by_name: dict[str, Expr] = field(default_factory=dict)
    #: rule nodes' centred tangents (``dS − ⟨A, dS⟩`` of a row softmax ``A`` of ``S``),
    #: which their second-order rules reuse
    centred: dict[str, Expr] = field(default_factory=dict)

    def of(self, tensor: Tensor) -> Expr:
        """The tangent of ``tensor`` (zero, over the right indices, when it has none)."""
        expr = self.by_name.get(tensor.name)
        return expr if expr is not None else Expr([], tensor.indices + self.indices)


def instantiate(graph: Graph, expr: Expr, mapping: dict[Index, Index]) -> list[Term]:
    """The terms of ``expr`` with free indices renamed by ``mapping`` and summed indices
    renamed to fresh ones (so they cannot capture indices of the surrounding term)."""
    out = []
    for term in expr.terms:
        local = dict(mapping)
        for index in term.indices():
            if index not in local:
                local[index] = graph.pool.fresh(index.dim, "s")
        out.append(term.renamed(local))
    return out


def _factor_tangent(graph: Graph, factor: Ref | Apply, tangents: Tangents,
                    dir_map: dict[Index, Index]) -> list[Term]:
    """The tangent of one factor, as terms in the surrounding term's indices."""
    tensor = graph.tensors[factor.name]
    mapping = dict(zip(tensor.indices, factor.indices)) | dir_map
    terms = instantiate(graph, tangents.by_name[factor.name], mapping)
    if isinstance(factor, Ref):
        return terms
    coeff, outer = applied(factor.fn.diff(), factor.name, factor.indices)
    return [Term(coeff * t.coeff, outer + t.factors) for t in terms] if coeff != 0 else []


def applied(fn, name: str, indices: tuple[Index, ...]) -> tuple[sp.Expr, tuple]:
    """``fn(name)[indices]`` as a coefficient and factors: a constant function (a zero
    second derivative, the slope of the identity) becomes a number, not an array."""
    if fn.expr.is_number:
        return fn.expr, ()
    return sp.Integer(1), (Apply(fn, name, indices),)


def close(term: Term, summed: set[Index]) -> Term:
    """``term`` summed over the indices of ``summed`` that none of its factors carries
    any more (a sum of a constant over ``n`` values is ``n`` times it)."""
    absent = summed - set(term.indices())
    return Term(term.coeff * sp.Mul(*(i.dim for i in absent)), term.factors) if absent else term


def _product(term: Term, replacements: dict[int, list[Term]],
             free: tuple[Index, ...]) -> list[Term]:
    """``term`` (free indices ``free``) with the factors at the given positions replaced
    by sums of terms."""
    summed = set(term.indices()) - set(free)
    partial = [Term(term.coeff)]
    for position, factor in enumerate(term.factors):
        options = replacements.get(position, [Term(sp.Integer(1), (factor,))])
        partial = [Term(p.coeff * o.coeff, p.factors + o.factors)
                   for p in partial for o in options]
    return [close(t, summed) for t in partial]


def differentiable(assign) -> bool:
    return assign.differentiable


def _depends(factor, tangents: Tangents) -> bool:
    return not isinstance(factor, Delta) and factor.name in tangents.by_name


def differentiate(graph: Graph, expr: Expr, tangents: Tangents,
                  dir_map: dict[Index, Index] | None = None) -> Expr:
    """Directional derivative of ``expr`` by the product rule: free indices
    ``expr.free`` followed by the (mapped) direction indices."""
    dir_map = dir_map or {i: i for i in tangents.indices}
    terms = []
    for term in expr.terms:
        for k, factor in enumerate(term.factors):
            if _depends(factor, tangents):
                replacement = _factor_tangent(graph, factor, tangents, dir_map)
                terms += _product(term, {k: replacement}, expr.free)
    free = expr.free + tuple(dir_map[i] for i in tangents.indices)
    return Expr(terms, free).simplified()


def second_local(graph: Graph, expr: Expr, first: Tangents, second: Tangents,
                 first_map: dict[Index, Index], second_map: dict[Index, Index]) -> Expr:
    """The part of the second derivative of ``expr`` that is not linear in second
    tangents: the product rule on two distinct factors, and ``f''`` of elementwise
    functions. Free indices: ``expr.free``, then the first and second direction's."""
    terms = []
    for term in expr.terms:
        for k, fk in enumerate(term.factors):
            if not _depends(fk, first):
                continue
            for m, fm in enumerate(term.factors):
                if m != k and _depends(fm, second):
                    terms += _product(term, {
                        k: _factor_tangent(graph, fk, first, first_map),
                        m: _factor_tangent(graph, fm, second, second_map)}, expr.free)
            if isinstance(fk, Apply) and _depends(fk, second):
                scale, curvature = applied(fk.fn.diff().diff(), fk.name, fk.indices)
                if scale == 0:
                    continue
                tensor = graph.tensors[fk.name]
                base = dict(zip(tensor.indices, fk.indices))
                for a in instantiate(graph, first.by_name[fk.name], base | first_map):
                    for b in instantiate(graph, second.by_name[fk.name], base | second_map):
                        factor = Term(scale * a.coeff * b.coeff,
                                      curvature + a.factors + b.factors)
                        terms += _product(term, {k: [factor]}, expr.free)
    free = (expr.free + tuple(first_map[i] for i in first.indices)
            + tuple(second_map[i] for i in second.indices))
    return Expr(terms, free).simplified()


def seed(graph: Graph, variable: Tensor, hint: str = "p") -> Tangents:
    """The tangent of ``variable`` with respect to its own entries: a product of deltas."""
    indices = tuple(graph.index(i.dim, hint) for i in variable.indices)
    identity = Expr([Term(sp.Integer(1), tuple(Delta(a, b)
                                              for a, b in zip(variable.indices, indices)))])
    return Tangents(indices, {variable.name: identity.with_free(variable.indices + indices)})


def row_seed(graph: Graph, variable: Tensor, rows: Tensor, hint: str = "p") -> Tangents:
    """The tangent of ``variable`` along the columns of ``rows`` (``(n_0, R)``) on its first
    axis and along its own entries on the others: ``rows[a_0, r] Π δ``, directions
    ``(r, a_1', …)``. With ``rows`` columns of the identity, derivatives in these directions
    are those in the entries of the rows they select."""
    first = graph.index(rows.indices[1].dim, "r")
    rest = tuple(graph.index(i.dim, hint) for i in variable.indices[1:])
    seed = Expr([Term(sp.Integer(1), (Ref(rows.name, (variable.indices[0], first)),
                                      *(Delta(a, b) for a, b in zip(variable.indices[1:],
                                                                    rest))))])
    return Tangents((first, *rest),
                    {variable.name: seed.with_free(variable.indices + (first, *rest))})


def _check_intermediates(assigns: list) -> None:
    """A primitive's intermediates carry no derivative: only the primitive may read them."""
    internal = {a.target.name for a in assigns if a.internal}
    for assign in assigns:
        read = assign.expr.names() & internal
        assert assign.internal or assign.rule is not None or not read, (
            f"{assign.target.name} reads {sorted(read)}, intermediates of a primitive whose "
            "derivatives are its rule's; read the primitive's output instead")


def propagate(graph: Graph, assigns: list, tangents: Tangents, label: str) -> Tangents:
    """Forward-propagate ``tangents`` through ``assigns`` (in order); each non-zero tangent
    is bound as ``d<node>_<label>`` when it is not cheap to carry inline."""
    _check_intermediates(assigns)
    for assign in filter(differentiable, assigns):
        with graph.sublayer(assign.sublayer):
            if assign.rule is not None:
                tangent = assign.rule.tangent(graph, assign.target, tangents, label)
            else:
                tangent = differentiate(graph, assign.expr, tangents)
            if not tangent.is_zero:
                name = f"d{assign.target.name}_{label}"
                tangents.by_name[assign.target.name] = graph.bind(name, tangent)
    return tangents


def propagate_second(graph: Graph, assigns: list, first: Tangents, second: Tangents,
                     second_map: dict[Index, Index], label: str) -> Tangents:
    """Second tangents ``d²node / d first d second`` through ``assigns``: the chain rule
    ``Σ ∂node/∂m · d²m`` plus the second-order local part of each node."""
    first_map = {i: i for i in first.indices}
    both = Tangents(first.indices + tuple(second_map[i] for i in second.indices))
    for assign in filter(differentiable, assigns):
        with graph.sublayer(assign.sublayer):
            if assign.rule is not None:
                total = assign.rule.second(graph, assign.target, first, second, second_map,
                                           both, label)
            else:
                expr = differentiate(graph, assign.expr, both)
                local = second_local(graph, assign.expr, first, second, first_map, second_map)
                total = Expr(expr.terms + local.terms, expr.free).simplified()
            if not total.is_zero:
                name = f"d2{assign.target.name}_{label}"
                both.by_name[assign.target.name] = graph.bind(name, total)
    return both


def propagate_adjoints(graph: Graph, assigns: list, output: Tensor, seed_expr: Expr) -> dict:
    """Adjoints ``∂ℓ/∂m`` of every tensor that ``output`` depends on through
    ``assigns`` (reverse mode), each bound as ``g_<name>`` when not cheap inline."""
    pending: dict[str, list[Term]] = {}
    adjoints = {output.name: seed_expr}
    defined = {a.target.name for a in assigns}
    _check_intermediates(assigns)
    assigns = list(filter(differentiable, assigns))
    for assign in reversed(assigns):
        name = assign.target.name
        if name in pending:
            adjoints[name] = _bind_adjoint(graph, graph.tensors[name], pending.pop(name))
        if name not in adjoints:
            continue
        target = assign.target
        if assign.rule is not None:
            with graph.sublayer(assign.sublayer):
                moved = assign.rule.adjoint(graph, target, adjoints[name])
            for source, terms in moved.items():
                pending.setdefault(source, []).extend(terms)
            continue
        for term in assign.expr.terms:
            for k, factor in enumerate(term.factors):
                if isinstance(factor, Delta):
                    continue
                tensor = graph.tensors[factor.name]
                if tensor.role in ("target", "direction", "constant"):
                    continue
                mapping = {i: graph.pool.fresh(i.dim, "s")
                           for i in dict.fromkeys(term.indices() + list(target.indices))}
                local = term.renamed(mapping)
                outer = instantiate(graph, adjoints[name],
                                    {i: mapping[i] for i in target.indices})
                moved = local.factors[k]
                ties = tuple(Delta(a, b) for a, b in zip(moved.indices, tensor.indices))
                rest = local.factors[:k] + local.factors[k + 1:]
                scale = sp.Integer(1)
                if isinstance(factor, Apply):
                    scale, slope = applied(factor.fn.diff(), factor.name, moved.indices)
                    if scale == 0:
                        continue
                    rest = rest + slope
                summed = set(mapping.values())
                for o in outer:
                    pending.setdefault(factor.name, []).append(close(
                        Term(scale * o.coeff * local.coeff, o.factors + rest + ties), summed))
    for name, terms in pending.items():
        assert name not in defined
        tensor = graph.tensors[name]
        if tensor.role == "param":
            # left inline: a parameter's gradient, averaged over the batch, then contracts
            # the batch with the sequence in one product (never a per-sample gradient)
            adjoints[name] = Expr(terms, tensor.indices).simplified()
        else:
            adjoints[name] = _bind_adjoint(graph, tensor, terms)
    return adjoints


def _bind_adjoint(graph: Graph, tensor: Tensor, terms: list[Term]) -> Expr:
    """The adjoint of ``tensor`` as a named node ``g_<name>`` (a constant stays inline)."""
    expr = Expr(terms, tensor.indices).simplified()
    constant = all(not t.data_factors for t in expr.terms)
    sublayer = next((a.sublayer for a in graph.assigns if a.target is tensor), "")
    with graph.sublayer(sublayer):
        return graph.bind(f"g_{tensor.name}", expr, force=not constant)


def hessian_by_adjoints(graph: Graph, assigns: list, adjoints: dict, first: Tangents,
                        second: Tangents, second_map: dict[Index, Index]) -> Expr:
    """``Σ_n Σ_r adjoint_n[r] · (second-order local part of node n)[r, ·, ·]`` over
    ``assigns``: the part of the loss Hessian that these nodes contribute."""
    first_map = {i: i for i in first.indices}
    free = first.indices + tuple(second_map[i] for i in second.indices)
    terms: list[Term] = []
    for assign in filter(differentiable, assigns):
        if assign.target.name not in adjoints:
            continue
        if assign.rule is not None:
            terms += assign.rule.hessian(graph, assign.target, adjoints, first, second,
                                         second_map)
            continue
        local = second_local(graph, assign.expr, first, second, first_map, second_map)
        if local.is_zero:
            continue
        node = {i: graph.pool.fresh(i.dim, "s") for i in assign.target.indices}
        outer = instantiate(graph, adjoints[assign.target.name], node)
        inner = instantiate(graph, local, node | {i: i for i in free})
        summed = set(node.values())
        terms += [close(Term(o.coeff * t.coeff, o.factors + t.factors), summed)
                  for o in outer for t in inner]
    return Expr(terms, free).simplified()
