"""From a config to every derived quantity of the generated-module contract.

:func:`derive` builds the forward graph of the configured sublayer and its loss, then
derives, as groups of index-form assignments (each group becomes one generated function):

``forward``                 the network's nodes, ending in the output ``Z`` (``L×d``, or
                            ``L×c``, ``1×c`` for a head);
``loss``                    the per-sample loss ``ell``;
``tangent_V``               ``d node / d V`` for every network node (forward mode);
``jacobian_V``              ``∂Z/∂V`` as a dense array ``(L, d, *shape(V))``;
``second_V_W``              ``∂²Z/∂V∂W``, dense ``(L, d, *shape(V), *shape(W))``;
``loss_tangent_V``          tangents of the loss nodes;
``loss_adjoints``           ``∂ell/∂node`` for the loss's nodes and ``Z`` (reverse mode);
``adjoints``                ``∂ell/∂node`` for every node of the network;
``loss_hessian_V_W``        Gauss–Newton and functional parts of the loss Hessian block
                            ``(*shape(V), *shape(W))``: the second-order adjoint method
                            (``V = X``: per sample, with ``W = X`` or a parameter);
``loss_hessian_full_V_W``   the same block whole (their sum, sharing their products);
``gradient``                ``∂ell/∂V`` for every variable, as dense arrays;
``per_sample_gradient``     each sample's own ``∂ell_b/∂V`` for every variable, ``(B, *shape(V))``;
``hvp_params``, ``hvp_X``   Hessian-vector products: forward mode over the adjoints.
``diagonal_<part>_V``       the diagonal of the loss Hessian block ``(V, V)`` (``part``
                            ``gauss_newton`` or ``functional``), shaped as ``V``: the
                            block's expression with its two directions identified, so the
                            block itself is never formed;
``diagonal_rows_<part>_V``  the same for the rows of a parameter that the columns of
                            ``rows_V`` select, ``(R, *shape(V)[1:])`` (with its own
                            ``tangent_rows_V``, ``loss_tangent_rows_V``);
``kronecker_<part>_V_W``    the factors of a block over two matrix parameters that is exactly
                            a sum of Kronecker products ``Σ_k A_k ⊗ B_k`` (:mod:`.kronecker`;
                            ``structured`` lists them, ``None`` marking an identity);
``gnvp_joint``              the Gauss–Newton part ``J^T (∂²ℓ/∂Z²) J`` times one joint
                            direction: forward mode over the loss and the adjoints with the
                            network's nodes held fixed (only ``Z`` moves, along ``J u``).
``jvp``                     ``dZ`` along directions ``u_V`` in every variable at once;
``hvp_joint``               the Hessian over every variable (``X`` and the parameters) times
                            one joint direction ``u`` (and the input's gradient): the pieces
                            a chain of modules needs;
``per_sample_hvp_joint``,   its (and ``gnvp_joint``'s) products in the parameters, each
``per_sample_gnvp_joint``   sample's own, ``(B, *shape(V))`` (a tied parameter's diagonal).

Row-major reshapes of these arrays are the paper's ``vec_r`` numerator layout.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import sympy as sp

from . import calculus, kronecker_structure, losses, sizes
from . import program as programs
from .config import Config
from .graph import Graph, Guard, Tensor
from .indexform import Expr, Index, Term
from .network import build_network
from .program import Program

Directions = tuple[tuple[Index, ...], tuple[Index, ...]]


@dataclass
class Group:
    """One generated function: its name, the groups it reads from, and the indices of its
    first and second derivative directions (their place in a derived tensor's paper layout:
    rows are the rest, columns the last)."""

    name: str
    requires: tuple[str, ...]
    directions: Directions = ((), ())


@dataclass(frozen=True)
class Quantity:
    """One array of the generated-module contract, held by the graph output ``node``.

    ``kind`` is ``jacobian`` (``wrt = (V,)``), ``output_hessian`` (``(V, W)``),
    ``loss_hessian`` (``(V, W)``, ``part`` ``full``, ``gauss_newton`` or ``functional``),
    ``gradient`` (``(V,)``) or ``hvp`` (``(V,)``, its direction read from the input
    ``direction``)."""

    kind: str
    wrt: tuple[str, ...]
    node: str
    part: str = "full"
    direction: str = ""


@dataclass
class Derivation:
    """A config's (or a program's) network, its loss, and every derived quantity: ``groups``
    (the generated functions, in order) and ``quantities`` (which output node holds each
    contract array)."""

    config: Config | Program
    graph: Graph
    X: Tensor
    target: Tensor
    output: Tensor
    loss: Tensor
    params: list[Tensor]
    guards: list[Guard]
    #: shapes users pass where they differ from the engine's (heads split out of a width)
    external_shapes: dict[str, tuple[str, ...]]
    groups: dict[str, Group] = field(default_factory=dict)
    quantities: list[Quantity] = field(default_factory=list)
    #: ``(V, W, part)`` → the output nodes ``(A_k, B_k)`` of each Kronecker product of the
    #: block (``None``: an identity), for the blocks that are exactly such sums
    structured: dict[tuple[str, str, str], list[tuple[str | None, str | None]]] = field(
        default_factory=dict)

    @property
    def input_varies(self) -> bool:
        """Whether ``X`` is a variable (not where it holds token ids' one-hot rows: data)."""
        return not (isinstance(self.config, Program) and self.config.tokens)

    @property
    def variables(self) -> list[Tensor]:
        return [*self.params, self.X] if self.input_varies else list(self.params)

    def add_group(self, name: str, requires: tuple[str, ...],
                  directions: Directions = ((), ())) -> AbstractContextManager[None]:
        """Register group ``name`` (one generated function, run after ``requires``); the
        assignments made inside the returned context belong to it."""
        self.groups[name] = Group(name, requires, directions)
        return self.graph.group(name)

    def add(self, kind: str, wrt: tuple[str, ...], node: Tensor, part: str = "full",
            direction: str = "") -> None:
        self.quantities.append(Quantity(kind, wrt, node.name, part, direction))

    def nodes(self, kind: str, parts: tuple[str, ...] = ("full",), key: str = "wrt") -> dict:
        """The quantities of ``kind`` (and of ``parts``) by ``wrt``: a single variable's by
        its name, a pair's by ``(V, W)``, with ``part`` appended when several parts are
        asked for; the values are their output nodes (``key="node"``) or their directions
        (``key="direction"``)."""
        table = {}
        for q in self.quantities:
            if q.kind == kind and q.part in parts:
                wrt = q.wrt[0] if len(q.wrt) == 1 else q.wrt
                table[(*q.wrt, q.part) if len(parts) > 1 else wrt] = getattr(
                    q, "node" if key == "wrt" else key)
        return table

    def directions(self) -> dict[str, Directions]:
        """Group name → its direction indices."""
        return {name: group.directions for name, group in self.groups.items()}


def derive(config: Config | Program) -> Derivation:
    """Every group of assignments that the generated modules of ``config`` (or of a program
    read from a module) need. A program's ``scope`` may leave some out: ``"products"`` the
    blocks (first-order tangents, Jacobians, loss-Hessian blocks, diagonals, Kronecker
    factors) and the output Hessians, ``"blocks"`` the output Hessians."""
    g = Graph()
    external: dict[str, tuple[str, ...]] = {}
    with g.group("forward"):
        if isinstance(config, Program):
            X, Z, params, guards = programs.build(g, config)
            external.update(programs.external_shapes(config))
        else:
            X, Z, params, guards = build_network(g, config, external)
    target = g.input("T", Z.shape, role="target")
    with g.group("loss"), g.sublayer("Loss"):
        ell = losses.build(g, config.loss, Z, target)
    der = Derivation(config, g, X, target, Z, ell, params, guards, external)
    der.groups["forward"] = Group("forward", ())
    der.groups["loss"] = Group("loss", ("forward",))
    scope = config.scope if isinstance(config, Program) else "all"
    tangents = _first_order(der) if scope != "products" else {}
    if scope == "all":
        _output_hessians(der, tangents)
    # the loss's adjoints first (down to ∂ℓ/∂Z), then the network's: a Gauss–Newton
    # product reads the first and not the second
    with der.add_group("loss_adjoints", ("loss",)):
        seed = Expr([Term(sp.Integer(1))]).with_free(())
        adjoints = calculus.propagate_adjoints(g, g.in_group("loss"), ell, seed)
    with der.add_group("adjoints", ("loss_adjoints",)):
        adjoints |= calculus.propagate_adjoints(g, g.in_group("forward"), Z, adjoints[Z.name])
    if scope != "products":
        _loss_hessians(der, tangents, adjoints)
    _gradients(der, adjoints)
    _hessian_vector_products(der, adjoints)
    output_tangent = _joint_directions(der, adjoints)
    _gauss_newton_products(der, adjoints, output_tangent)
    _complete_requirements(der)
    return der


def _complete_requirements(der: Derivation) -> None:
    """Add to each group the groups that define what it reads, beyond those it names (a
    product may read a factor that a bound adjoint shares, held in the adjoints' group)."""
    defined = {a.target.name: a.group for a in der.graph.assigns}
    for name, group in der.groups.items():
        reads = {n for a in der.graph.in_group(name) for n in a.expr.names()}
        needed = sorted({defined[n] for n in reads if defined.get(n, name) != name}
                        - set(group.requires))
        group.requires = (*group.requires, *needed)


def _first_order(der: Derivation) -> dict[str, calculus.Tangents]:
    """Groups ``tangent_V``, ``jacobian_V`` and ``loss_tangent_V`` of every variable ``V``;
    the tangents by variable name."""
    g = der.graph
    forward, loss = g.in_group("forward"), g.in_group("loss")
    tangents: dict[str, calculus.Tangents] = {}
    for var in der.variables:
        v, start = var.name, calculus.seed(g, var)
        directions = (start.indices, ())
        with der.add_group(f"tangent_{v}", ("forward",), directions):
            tangents[v] = calculus.propagate(g, forward, start, v)
        with der.add_group(f"jacobian_{v}", (f"tangent_{v}",), directions):
            der.add("jacobian", (v,), g.output(f"jacobian_{v}", tangents[v].of(der.output)))
        with der.add_group(f"loss_tangent_{v}", ("loss", f"tangent_{v}"), directions):
            calculus.propagate(g, loss, tangents[v], v)
    return tangents


def _pair_directions(g: Graph, tangents: dict[str, calculus.Tangents], v: str, w: str
                     ) -> tuple[dict, Directions]:
    """The index map of the second direction, and the directions of the pair ``(V, W)``."""
    renamed = _second_direction(g, tangents[v], tangents[w], v == w)
    return renamed, (tangents[v].indices, tuple(renamed[i] for i in tangents[w].indices))


def _output_hessians(der: Derivation, tangents: dict[str, calculus.Tangents]) -> None:
    """Groups ``second_V_W``: ``∂²Z/∂V∂W`` for every ordered pair of variables."""
    g, forward = der.graph, der.graph.in_group("forward")
    for first in der.variables:
        for second in der.variables:
            v, w = first.name, second.name
            renamed, directions = _pair_directions(g, tangents, v, w)
            with der.add_group(f"second_{v}_{w}", (f"tangent_{v}", f"tangent_{w}"),
                               directions):
                both = calculus.propagate_second(g, forward, tangents[v], tangents[w],
                                                 renamed, f"{v}{w}")
                der.add("output_hessian", (v, w),
                        g.output(f"output_hessian_{v}_{w}", both.of(der.output)))


def _loss_hessians(der: Derivation, tangents: dict[str, calculus.Tangents],
                   adjoints: dict[str, Expr]) -> None:
    """Groups ``loss_hessian_V_W`` (Gauss–Newton and functional parts) and
    ``loss_hessian_full_V_W`` (their sum) for parameter pairs ``V ≤ W`` (averaged over the
    batch), and per sample for ``X, X`` and for ``X, W`` with every parameter ``W``."""
    g = der.graph
    forward, loss = g.in_group("forward"), g.in_group("loss")
    pairs = [(a, b) for n, a in enumerate(der.params) for b in der.params[n:]]
    if der.input_varies:
        pairs += [(der.X, der.X), *((der.X, p) for p in der.params)]
    for first, second in pairs:
        v, w = first.name, second.name
        renamed, directions = _pair_directions(g, tangents, v, w)
        requires = ("adjoints", f"loss_tangent_{v}", f"loss_tangent_{w}")
        mean = first is not der.X
        blocks = {}
        with der.add_group(f"loss_hessian_{v}_{w}", requires, directions):
            for part, assigns in (("gauss_newton", loss), ("functional", forward)):
                blocks[part] = calculus.hessian_by_adjoints(g, assigns, adjoints, tangents[v],
                                                            tangents[w], renamed)
                der.add("loss_hessian", (v, w),
                        g.output(f"{part}_{v}_{w}", blocks[part], mean_over_batch=mean), part)
        # the whole block as one node too: its terms then share their products (one
        # contraction where the two parts each had their own)
        with der.add_group(f"loss_hessian_full_{v}_{w}", requires, directions):
            gauss_newton = blocks["gauss_newton"]
            whole = (gauss_newton + blocks["functional"]).with_free(gauss_newton.free)
            der.add("loss_hessian", (v, w),
                    g.output(f"full_{v}_{w}", whole, mean_over_batch=mean))
        if v == w:
            _diagonals(der, v, requires, tangents[v].indices, renamed, blocks, mean)
            if mean and first.indices:  # a scalar parameter has no rows to take
                _row_diagonals(der, first, adjoints)
        if mean and all(len(t.indices) == 2 and t.name not in der.external_shapes
                        for t in (first, second)):
            _kronecker_factors(der, v, w, requires, {**blocks, "full": whole})


def _diagonals(der: Derivation, v: str, requires: tuple[str, ...],
               indices: tuple[Index, ...], renamed: dict, blocks: dict[str, Expr],
               mean: bool) -> None:
    """Groups ``diagonal_gauss_newton_V`` and ``diagonal_functional_V``: the diagonal of each
    part of the block ``(V, V)`` (``blocks``), its second direction's indices ``renamed``
    identified with the first's ``indices`` (``δ[a, a] = 1``), shaped as ``V``."""
    identified = {renamed[i]: i for i in indices}
    for part, block in blocks.items():
        with der.add_group(f"diagonal_{part}_{v}", requires, (indices, ())):
            diagonal = Expr([t.renamed(identified) for t in block.terms], indices)
            der.add("diagonal", (v,), der.graph.output(
                f"diagonal_{part}_{v}", diagonal.simplified(), mean_over_batch=mean), part)


def _row_diagonals(der: Derivation, var: Tensor, adjoints: dict[str, Expr]) -> None:
    """Groups ``tangent_rows_V``, ``loss_tangent_rows_V`` and ``diagonal_rows_<part>_V``:
    the diagonal of each part of the block ``(V, V)`` in the directions of the columns of
    ``rows_V`` (``(n_0, R)``) on ``V``'s first axis, shaped ``(R, *shape(V)[1:])``; with
    columns of the identity, the diagonal of the ``R`` rows they select, whose tangents hold
    ``R/n_0`` of the whole diagonal's (a large parameter's diagonal in bounded memory)."""
    g, v = der.graph, var.name
    forward, loss = g.in_group("forward"), g.in_group("loss")
    rows = g.input(f"rows_{v}", (var.indices[0].dim, sizes.R), role="direction",
                   batched=False)
    start = calculus.row_seed(g, var, rows)
    directions = (start.indices, ())
    with der.add_group(f"tangent_rows_{v}", ("forward",), directions):
        tangents = calculus.propagate(g, forward, start, f"rows_{v}")
    with der.add_group(f"loss_tangent_rows_{v}", ("loss", f"tangent_rows_{v}"), directions):
        calculus.propagate(g, loss, tangents, f"rows_{v}")
    renamed = _second_direction(g, tangents, tangents, True)
    requires = ("adjoints", f"loss_tangent_rows_{v}")
    blocks = {}
    with der.add_group(f"loss_hessian_rows_{v}", requires,
                       (start.indices, tuple(renamed[i] for i in start.indices))):
        for part, assigns in (("gauss_newton", loss), ("functional", forward)):
            blocks[part] = calculus.hessian_by_adjoints(g, assigns, adjoints, tangents,
                                                        tangents, renamed)
    identified = {renamed[i]: i for i in start.indices}
    for part, block in blocks.items():
        with der.add_group(f"diagonal_rows_{part}_{v}", requires, directions):
            diagonal = Expr([t.renamed(identified) for t in block.terms], start.indices)
            der.add("diagonal_rows", (v,), g.output(
                f"diagonal_rows_{part}_{v}", diagonal.simplified(), mean_over_batch=True),
                part, direction=rows.name)


def _kronecker_factors(der: Derivation, v: str, w: str, requires: tuple[str, ...],
                       blocks: dict[str, Expr]) -> None:
    """Groups ``kronecker_<part>_V_W``: for each part of the block ``(V, W)`` that is exactly
    a sum of Kronecker products, the factors ``A_k`` (``(p, p')``) and ``B_k``
    (``(q, q')``), averaged over the batch."""
    g = der.graph
    for part, block in blocks.items():
        products = kronecker_structure.kronecker_products(g, block)
        if not products:
            continue
        nodes = []
        with der.add_group(f"kronecker_{part}_{v}_{w}", requires):
            for k, product in enumerate(products):
                names = []
                for side, factor in (("left", product.left), ("right", product.right)):
                    names.append(None if factor is None else g.output(
                        f"kronecker_{part}_{v}_{w}_{k}_{side}", factor,
                        mean_over_batch=True).name)
                nodes.append(tuple(names))
        der.structured[v, w, part] = nodes


def _gradients(der: Derivation, adjoints: dict[str, Expr]) -> None:
    """Group ``gradient``: ``∂ell/∂V`` of every parameter (averaged over the batch) and of
    ``X`` (per sample), shaped as the variable; group ``per_sample_gradient``: each
    sample's own ``∂ell_b/∂V`` of every variable, ``(B, *shape(V))`` (what a chain's exact
    diagonal multiplies entry by entry)."""
    with der.add_group("gradient", ("adjoints",)):
        for var in der.variables:
            der.add("gradient", (var.name,), der.graph.output(
                f"gradient_{var.name}", adjoints[var.name], mean_over_batch=var is not der.X))
    with der.add_group("per_sample_gradient", ("adjoints",)):
        for var in der.variables:
            der.add("per_sample_gradient", (var.name,), der.graph.output(
                f"per_sample_gradient_{var.name}", adjoints[var.name]))


def _hessian_vector_products(der: Derivation, adjoints: dict[str, Expr]) -> None:
    """Groups ``hvp_params`` and ``hvp_X``: forward mode along directions ``v_V`` over the
    adjoints, ``(Hv)_V`` the directional derivative of ``∂ℓ/∂V``."""
    g = der.graph
    program = (g.in_group("forward") + g.in_group("loss") + g.in_group("loss_adjoints")
               + g.in_group("adjoints"))
    for label, variables in (("params", der.params), ("X", der.variables[len(der.params):])):
        if not variables:
            continue
        with der.add_group(f"hvp_{label}", ("adjoints",)):
            directions, inputs = calculus.Tangents(()), {}
            for var in variables:
                inputs[var.name] = g.input(f"v_{var.name}", var.shape, role="direction",
                                           batched=var is der.X)
                directions.by_name[var.name] = inputs[var.name][var.indices].with_free(
                    var.indices)
            calculus.propagate(g, program, directions, f"v{label}")
            for var in variables:
                hv = calculus.differentiate(g, adjoints[var.name], directions)
                der.add("hvp", (var.name,), g.output(f"hvp_{var.name}", hv,
                                                     mean_over_batch=var is not der.X),
                        direction=inputs[var.name].name)


def _joint_directions(der: Derivation, adjoints: dict[str, Expr]) -> None:
    """Groups ``jvp`` (``dZ`` along directions ``u_V`` in every variable, per sample) and
    ``hvp_joint`` (forward mode along the same directions and one ``u_T`` in the target,
    over the adjoints: the parameters' product averaged over the batch, ``X``'s per
    sample). ``hvp_joint`` continues from ``jvp``'s tangents of the forward nodes (a chain
    computes them on its way up), so its own sweep covers only the loss and the adjoints."""
    g = der.graph
    directions, inputs = calculus.Tangents(()), {}
    for var in der.variables:
        inputs[var.name] = g.input(f"u_{var.name}", var.shape, role="direction",
                                   batched=var is der.X)
        directions.by_name[var.name] = inputs[var.name][var.indices].with_free(var.indices)
    with der.add_group("jvp", ("forward",)):
        tangents = calculus.propagate(g, g.in_group("forward"), directions, "u")
        der.add("jvp", (), g.output("jvp_Z", tangents.of(der.output)))
        output_tangent = tangents.of(der.output)
    # the target has a direction too: with the linear loss Σ T∘Z its product is J^T u_T,
    # the second term of a cotangent's tangent when modules are chained
    target = g.input("u_T", der.target.shape, role="direction")
    tangents.by_name[der.target.name] = target[der.target.indices].with_free(
        der.target.indices)
    program = g.in_group("loss") + g.in_group("loss_adjoints") + g.in_group("adjoints")
    with der.add_group("hvp_joint", ("adjoints", "jvp")):
        if der.input_varies:  # the input's gradient on the way (a chain's next cotangent)
            der.add("joint_gradient", (der.X.name,),
                    g.output(f"joint_gradient_{der.X.name}", adjoints[der.X.name]))
        calculus.propagate(g, program, tangents, "w")
        products = {}
        for var in der.variables:
            products[var.name] = calculus.differentiate(g, adjoints[var.name], tangents)
            der.add("hvp_joint", (var.name,), g.output(
                f"hvp_joint_{var.name}", products[var.name], mean_over_batch=var is not der.X),
                direction=inputs[var.name].name)
    _each_sample(der, "hvp_joint", products)
    return output_tangent


def _gauss_newton_products(der: Derivation, adjoints: dict[str, Expr],
                           output_tangent: Expr) -> None:
    """Groups ``gnvp_params`` (``J_V^T (∂²ℓ/∂Z²) J v`` for every parameter ``V``, ``v`` the
    ``hvp`` groups' directions in the parameters, averaged over the batch) and ``gnvp_joint``
    (the same for every variable along the ``jvp`` group's output tangent ``J u``). Only ``Z``
    moves (the network's nodes are held fixed), so the adjoints' tangents are the linearised
    network's transpose applied to the loss's curvature along ``J v``: no second derivative
    of the network enters."""
    g = der.graph
    forward = g.in_group("forward")
    backward = g.in_group("loss") + g.in_group("loss_adjoints") + g.in_group("adjoints")

    def transposed(moving: calculus.Tangents, label: str, variables: list[Tensor],
                   kind: str) -> dict[str, Expr]:
        calculus.propagate(g, backward, moving, label)
        products = {}
        for var in variables:
            products[var.name] = calculus.differentiate(g, adjoints[var.name], moving)
            der.add(kind, (var.name,), g.output(
                f"{kind}_{var.name}", products[var.name], mean_over_batch=var is not der.X))
        return products

    if der.params:
        # the network's adjoints are not read: their tangents are linear in dg_Z alone
        with der.add_group("gnvp_params", ("loss_adjoints",)):
            directions = calculus.Tangents(())
            for var in der.params:
                direction = g.tensors[f"v_{var.name}"]
                directions.by_name[var.name] = direction[var.indices].with_free(var.indices)
            tangents = calculus.propagate(g, forward, directions, "gv")
            moving = calculus.Tangents((), {der.output.name: tangents.of(der.output)})
            transposed(moving, "gn", der.params, "gnvp_params")
    with der.add_group("gnvp_joint", ("jvp", "loss_adjoints")):
        products = transposed(calculus.Tangents((), {der.output.name: output_tangent}), "n",
                              der.variables, "gnvp_joint")
    _each_sample(der, "gnvp_joint", products)


def _each_sample(der: Derivation, group: str, products: dict[str, Expr]) -> None:
    """Group ``per_sample_<group>``: ``group``'s ``products`` in the parameters, each sample's
    own, ``(B, *shape(V))`` (the pairs of a tied parameter's diagonal)."""
    if not der.params:
        return
    with der.add_group(f"per_sample_{group}", (group,)):
        for var in der.params:
            der.add(f"per_sample_{group}", (var.name,), der.graph.output(
                f"per_sample_{group}_{var.name}", products[var.name]))


def _second_direction(g: Graph, first: calculus.Tangents, second: calculus.Tangents,
                      same: bool) -> dict:
    """Index map for the second direction: fresh indices when both directions are the
    same variable (so the two slots of a diagonal block stay distinct)."""
    if not same:
        return {i: i for i in second.indices}
    return {i: g.index(i.dim, "q") for i in second.indices}
