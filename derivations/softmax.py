"""The row softmax and the row log-sum-exp: primitives with closed-form local rules.

Both read a tensor ``S`` (``... × n``) row by row. Write ``⟨A, w⟩_r = Σ_k A_rk w_rk`` and
``c(w) = w − ⟨A, w⟩`` for a row centred by the softmax weights ``A``. For
``A = softmax_j(S)``, with ``u, v`` two directions:

* tangent            ``dA = A ∘ c(dS)``
* second tangent     ``d²A = A ∘ c(c(dS_u) ∘ c(dS_v) + d²S)``
* adjoint            ``ḡ_S = A ∘ c(ḡ_A)``
* loss-Hessian part  ``Σ (A ∘ c(ḡ_A)) ∘ c(dS_u) ∘ c(dS_v)`` (summed over every entry)

and for ``lse_r = log Σ_j exp(S_rj)`` with ``P = softmax(S)``:

* tangent            ``d lse = ⟨P, dS⟩``
* second tangent     ``d² lse = ⟨P, c(dS_u) ∘ c(dS_v) + d²S⟩``
* adjoint            ``ḡ_S = ḡ_lse P``
* loss-Hessian part  ``Σ ḡ_lse ⟨P, c(dS_u) ∘ c(dS_v)⟩``.

Every centred factor is a named node, computed before anything multiplies it. Written out
as the product rule gives it from ``exp`` and ``1/Σ`` (``A∘dS − A∘⟨A, dS⟩``, and a dozen
second-order terms), each term is as large as ``|dS|`` (``|dS|²``) and they cancel to
``(1 − max A)·|dS|`` when attention saturates: rounding then swamps the result. In centred
form each factor is as small as its exact value. The forward value is the shifted
``exp(S − max S) / Σ exp(S − max S)`` (no overflow); its intermediates carry no derivative.
The tests prove these rules against SymPy's derivatives of the forward definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp

from .calculus import Tangents, instantiate
from .functions import ScalarFn, exp, power, x
from .graph import Graph, Tensor
from .indexform import Expr, Index, Ref, Term

Reader = Callable[[tuple[Index, ...]], list[Term]]


def _product(first: list[Term], second: list[Term]) -> list[Term]:
    return [Term(a.coeff * b.coeff, a.factors + b.factors) for a in first for b in second]


def _centred(graph: Graph, weights: str, at: tuple[Index, ...], read: Reader,
             free: tuple[Index, ...]) -> Expr:
    """``w[at] − Σ_k weights[rows, k] w[rows, k]`` for ``w`` read by ``read`` (``at`` is
    ``rows + (last,)``), over the free indices ``free``."""
    rows, last = at[:-1], at[-1]
    k = graph.pool.fresh(last.dim, "k")
    weighted = [Term(-t.coeff, (Ref(weights, rows + (k,)),) + t.factors)
                for t in read(rows + (k,))]
    return Expr(read(at) + weighted, free).simplified()


def _bind_scaled(graph: Graph, name: str, expr: Expr) -> Expr:
    """``expr`` as named nodes of unit coefficients, one per class of terms whose
    coefficients differ by a rational factor (``name``, ``name_2``, ...), times those
    coefficients. Each node then holds plain differences such as ``K − A K``, exactly zero
    where the two sides are equal: scaling each side first, or fusing a scale into an
    addition, leaves a rounding residue that a saturated softmax multiplies by 1."""
    classes: list[tuple[sp.Expr, list[Term]]] = []
    for term in expr.terms:
        for common, members in classes:
            if sp.cancel(term.coeff / common).is_Rational:  # a number, not a size ratio
                members.append(term)
                break
        else:
            classes.append((term.coeff, [term]))
    terms = []
    for n, (common, members) in enumerate(classes):
        unit = Expr([Term(sp.cancel(t.coeff / common), t.factors) for t in members], expr.free)
        node = graph.bind(name if n == 0 else f"{name}_{n + 1}", unit, force=True)
        terms += [Term(common * t.coeff, t.factors) for t in node.terms]
    return Expr(terms, expr.free)


def _reader(graph: Graph, expr: Expr, indices: tuple[Index, ...],
            directions: dict[Index, Index]) -> Reader:
    """Read ``expr`` (free: ``indices`` then the directions' keys) at other indices."""
    return lambda at: instantiate(graph, expr, dict(zip(indices, at)) | directions)


def _identity(indices: tuple[Index, ...]) -> dict[Index, Index]:
    return {i: i for i in indices}


def _second_reader(graph: Graph, weights: Tensor, source: Tensor, first: Tangents,
                   second: Tangents, second_map: dict[Index, Index],
                   both: Tangents | None) -> Reader:
    """``c(dS_u) ∘ c(dS_v)`` (the centred tangents of the rule node ``weights``) plus, with
    ``both``, the second tangent ``d²S``."""
    cu, cv = first.centred.get(weights.name), second.centred.get(weights.name)

    def read(at: tuple[Index, ...]) -> list[Term]:
        terms = []
        if cu is not None and cv is not None:
            terms += _product(
                _reader(graph, cu, weights.indices, _identity(first.indices))(at),
                _reader(graph, cv, weights.indices, second_map)(at))
        if both is not None and source.name in both.by_name:
            terms += _reader(graph, both.by_name[source.name], source.indices,
                             _identity(both.indices))(at)
        return terms
    return read


@dataclass(frozen=True)
class RowSoftmax:
    """The rules of ``A = softmax(S)`` over the last axis (``source`` names ``S``)."""

    source: str

    def tangent(self, graph: Graph, target: Tensor, tangents: Tangents, label: str) -> Expr:
        """``A ∘ c(dS)``, with ``c(dS)`` the node ``dc<A>_<label>``."""
        free = target.indices + tangents.indices
        if self.source not in tangents.by_name:
            return Expr([], free)
        source = graph.tensors[self.source]
        read = _reader(graph, tangents.by_name[self.source], source.indices,
                       _identity(tangents.indices))
        centred = _bind_scaled(graph, f"dc{target.name}_{label}",
                               _centred(graph, target.name, target.indices, read, free))
        tangents.centred[target.name] = centred
        return (target[target.indices] * centred).with_free(free)

    def second(self, graph: Graph, target: Tensor, first: Tangents, second: Tangents,
               second_map: dict[Index, Index], both: Tangents, label: str) -> Expr:
        """``A ∘ c(c(dS_u) ∘ c(dS_v) + d²S)``, the centred factor the node ``d2c<A>_<label>``."""
        free = target.indices + both.indices
        read = _second_reader(graph, target, graph.tensors[self.source], first, second,
                              second_map, both)
        centred = _bind_scaled(graph, f"d2c{target.name}_{label}",
                               _centred(graph, target.name, target.indices, read, free))
        if centred.is_zero:
            return centred
        return (target[target.indices] * centred).with_free(free)

    def adjoint(self, graph: Graph, target: Tensor, adjoint: Expr) -> dict[str, list[Term]]:
        """``ḡ_S = A ∘ c(ḡ_A)``, with ``c(ḡ_A)`` the node ``gc_<A>``."""
        if adjoint.is_zero:
            return {}
        read = _reader(graph, adjoint, target.indices, {})
        centred = graph.node(self.centred_adjoint(target), target.indices,
                             _centred(graph, target.name, target.indices, read, target.indices))
        source = graph.tensors[self.source]
        if source.role in ("target", "direction", "constant"):
            return {}
        return {self.source: [Term(sp.Integer(1), (Ref(target.name, source.indices),
                                                   Ref(centred.name, source.indices)))]}

    @staticmethod
    def centred_adjoint(target: Tensor) -> str:
        return f"gc_{target.name}"

    def hessian(self, graph: Graph, target: Tensor, adjoints: dict, first: Tangents,
                second: Tangents, second_map: dict[Index, Index]) -> list[Term]:
        """``Σ A ∘ c(ḡ_A) ∘ c(dS_u) ∘ c(dS_v)`` over every entry of ``A``."""
        centred = self.centred_adjoint(target)
        if centred not in graph.tensors:
            assert adjoints.get(target.name) is None or adjoints[target.name].is_zero, (
                f"{target.name} has an adjoint but no centred adjoint {centred}")
            return []
        at = tuple(graph.pool.fresh(i.dim, "s") for i in target.indices)
        read = _second_reader(graph, target, graph.tensors[self.source], first, second,
                              second_map, None)
        weight = (Ref(target.name, at), Ref(centred, at))
        return [Term(t.coeff, weight + t.factors) for t in read(at)]


@dataclass(frozen=True)
class RowLogSumExp:
    """The rules of ``lse = log Σ_j exp(S_j)`` over the last axis, given the node
    ``probabilities = softmax(S)`` (a :class:`RowSoftmax` node computed before it)."""

    source: str
    probabilities: str

    def _weighted(self, graph: Graph, target: Tensor, read: Reader,
                  free: tuple[Index, ...]) -> Expr:
        """``⟨P, w⟩`` for ``w`` read by ``read``."""
        k = graph.pool.fresh(graph.tensors[self.source].indices[-1].dim, "k")
        at = target.indices + (k,)
        return Expr([Term(t.coeff, (Ref(self.probabilities, at),) + t.factors)
                     for t in read(at)], free).simplified()

    def tangent(self, graph: Graph, target: Tensor, tangents: Tangents, label: str) -> Expr:
        """``⟨P, dS⟩``."""
        free = target.indices + tangents.indices
        if self.source not in tangents.by_name:
            return Expr([], free)
        read = _reader(graph, tangents.by_name[self.source],
                       graph.tensors[self.source].indices, _identity(tangents.indices))
        return self._weighted(graph, target, read, free)

    def second(self, graph: Graph, target: Tensor, first: Tangents, second: Tangents,
               second_map: dict[Index, Index], both: Tangents, label: str) -> Expr:
        """``⟨P, c(dS_u) ∘ c(dS_v) + d²S⟩``."""
        read = _second_reader(graph, graph.tensors[self.probabilities],
                              graph.tensors[self.source], first, second, second_map, both)
        return self._weighted(graph, target, read, target.indices + both.indices)

    def adjoint(self, graph: Graph, target: Tensor, adjoint: Expr) -> dict[str, list[Term]]:
        """``ḡ_S = ḡ_lse P``."""
        source = graph.tensors[self.source]
        if adjoint.is_zero or source.role in ("target", "direction", "constant"):
            return {}
        at = source.indices
        outer = instantiate(graph, adjoint, dict(zip(target.indices, at[:-1])))
        return {self.source: [Term(t.coeff, t.factors + (Ref(self.probabilities, at),))
                              for t in outer]}

    def hessian(self, graph: Graph, target: Tensor, adjoints: dict, first: Tangents,
                second: Tangents, second_map: dict[Index, Index]) -> list[Term]:
        """``Σ_r ḡ_lse[r] ⟨P, c(dS_u) ∘ c(dS_v)⟩_r``."""
        adjoint = adjoints.get(target.name)
        if adjoint is None or adjoint.is_zero:
            return []
        rows = tuple(graph.pool.fresh(i.dim, "s") for i in target.indices)
        read = _second_reader(graph, graph.tensors[self.probabilities],
                              graph.tensors[self.source], first, second, second_map, None)
        k = graph.pool.fresh(graph.tensors[self.source].indices[-1].dim, "k")
        weights = [Term(t.coeff, t.factors + (Ref(self.probabilities, rows + (k,)),))
                   for t in instantiate(graph, adjoint, dict(zip(target.indices, rows)))]
        return _product(weights, read(rows + (k,)))


def _shifted_exp(g: Graph, S: Tensor, idx: tuple[Index, ...], prefix: str,
                 names: tuple[str, str, str, str]) -> tuple[Tensor, Tensor, Tensor]:
    """``m = max_j S`` (a constant), ``E = exp(S − m)`` and ``s = Σ_j E``: the forward
    intermediates (no derivative of their own)."""
    max_name, shift_name, exp_name, sum_name = (prefix + n for n in names)
    rows = idx[:-1]
    m = g.row_max(max_name, S)
    shifted = g.node(shift_name, idx, S[idx] - m[rows], internal=True)
    E = g.node(exp_name, idx, shifted.apply(exp(), *idx), internal=True)
    s = g.node(sum_name, rows, E[idx], internal=True)
    return m, E, s


def softmax_rows(g: Graph, T: Tensor, name: str = "A", prefix: str = "",
                 causal: bool = False) -> Tensor:
    """``name = softmax`` over the last axis of ``T`` (``... × L × L``); with ``causal``,
    entries above the diagonal of the last two axes are set to ``-inf`` first. Nodes
    ``T_max`` (a constant shift), ``T_shift``, ``E``, ``E_sum`` compute the value; the
    derivatives are :class:`RowSoftmax`'s."""
    idx = tuple(g.index(dim, "i") for dim in T.shape)
    if causal:
        bias = g.causal_bias(f"{prefix}T_mask", T.shape[-1])
        T = g.node(f"{prefix}T_masked", idx, T[idx] + bias[idx[-2:]])
    _, E, s = _shifted_exp(g, T, idx, prefix, ("T_max", "T_shift", "E", "E_sum"))
    return g.node(name, idx, E[idx] * s.apply(power(-1, 0, "recip"), *idx[:-1]),
                  rule=RowSoftmax(T.name))


def log_sum_exp_rows(g: Graph, S: Tensor, prefix: str) -> Tensor:
    """``<prefix>lse_r = log Σ_j exp(S_rj)`` over the last axis of ``S``, with the node
    ``<prefix>P = softmax(S)`` that its derivatives read."""
    idx = tuple(g.index(dim, "i") for dim in S.shape)
    rows = idx[:-1]
    m, E, s = _shifted_exp(g, S, idx, prefix, ("max", "shift", "E", "sum"))
    P = g.node(f"{prefix}P", idx, E[idx] * s.apply(power(-1, 0, "recip"), *rows),
               rule=RowSoftmax(S.name))
    log = ScalarFn("log", sp.log(x))
    return g.node(f"{prefix}lse", rows, s.apply(log, *rows) + m[rows],
                  rule=RowLogSumExp(S.name, P.name))
