"""From a config to every derived quantity of the generated-module contract.

:func:`derive` builds the forward graph of the configured sublayer and its loss, then
derives, as groups of index-form assignments (each group becomes one generated function):

``forward``                 the network's nodes, ending in the output ``Z`` (``L×d``);
``loss``                    the per-sample loss ``ell``;
``tangent_V``               ``d node / d V`` for every network node (forward mode);
``jacobian_V``              ``∂Z/∂V`` as a dense array ``(L, d, *shape(V))``;
``second_V_W``              ``∂²Z/∂V∂W``, dense ``(L, d, *shape(V), *shape(W))``;
``loss_tangent_V``          tangents of the loss nodes;
``adjoints``                ``∂ell/∂node`` for every node (reverse mode);
``loss_hessian_V_W``        Gauss–Newton and functional parts of the loss Hessian block
                            ``(*shape(V), *shape(W))``: the second-order adjoint method;
``loss_hessian_full_V_W``   the same block whole (their sum, sharing their products);
``hvp_params``, ``hvp_X``   Hessian-vector products: forward mode over the adjoints.

Row-major reshapes of these arrays are the paper's ``vec_r`` numerator layout.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import sympy as sp

from . import attention, calculus, ffn, losses, normalization, sizes
from .config import Config
from .graph import Graph, Tensor
from .indexform import Expr, Index, Term
from .normalization import Guard

#: Section titles of the normalisation sublayers.
NORM_TITLES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass
class Group:
    """One generated function: its assignments and the groups it reads from."""

    name: str
    requires: tuple[str, ...]


@dataclass
class Derivation:
    config: Config
    graph: Graph
    X: Tensor
    target: Tensor
    output: Tensor
    loss: Tensor
    params: list[Tensor]
    guards: list[Guard]
    groups: dict[str, Group] = field(default_factory=dict)
    jacobian: dict[str, str] = field(default_factory=dict)
    output_hessian: dict[tuple[str, str], str] = field(default_factory=dict)
    loss_hessian: dict[tuple[str, str, str], str] = field(default_factory=dict)
    loss_hessian_full: dict[tuple[str, str], str] = field(default_factory=dict)
    hvp: dict[str, str] = field(default_factory=dict)
    directions: dict[str, str] = field(default_factory=dict)
    external_shapes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: group name -> the indices of its first and second derivative directions (their
    #: place in a derived tensor's paper layout: rows are the rest, columns the last)
    group_directions: dict[str, tuple[tuple[Index, ...], tuple[Index, ...]]] = field(
        default_factory=dict)

    @property
    def variables(self) -> list[Tensor]:
        return [*self.params, self.X]

    def add_group(self, name: str, requires: tuple[str, ...]) -> AbstractContextManager[None]:
        """Register group ``name`` (one generated function, run after ``requires``); the
        assignments made inside the returned context belong to it."""
        self.groups[name] = Group(name, requires)
        return self.graph.group(name)


def build_network(g: Graph, config: Config, external: dict | None = None
                   ) -> tuple[Tensor, Tensor, list[Tensor], list[Guard]]:
    """The forward nodes of the configured sublayer: input ``X``, output, parameters in
    the toolkit's order (``W_Q, W_K, W_V, W_O, W_1, b_1, W_2, b_2, gamma_1, beta_1,
    gamma_2, beta_2``, those present), and runtime guards; ``external`` collects the shapes
    users pass where they differ from the engine's."""
    external = {} if external is None else external
    X = g.input("X", (sizes.L, sizes.d))
    if config.kind == "layernorm":
        with g.sublayer(NORM_TITLES[config.norm]):
            norm = normalization.normalize(g, X, config.norm, config.eps, config.affine, "Z")
        return X, norm.output, norm.params, norm.guards
    if config.kind == "self_attention":
        with g.sublayer("Self-attention"):
            layer = attention.self_attention(g, X, config.heads, config.causal,
                                             config.out_proj)
        external.update(layer.external_shapes)
        return X, layer.output, layer.params, []
    if config.kind == "ffn":
        with g.sublayer("Feed-forward network"):
            layer = ffn.feed_forward(g, X, config.activation, config.ffn_bias, "Z")
        return X, layer.output, layer.params, []
    return (X, *_block(g, config, X, external))


def _block(g: Graph, config: Config, X: Tensor, external: dict
           ) -> tuple[Tensor, list[Tensor], list[Guard]]:
    """Post-LN: ``Y = LN_1(X + F(X))``, ``S = Y + FFN(Y)``, ``Z = LN_2(S)``.
    Pre-LN: ``Y = X + F(LN_1(X))``, ``Z = Y + FFN(LN_2(Y))``."""
    L, d = sizes.L, sizes.d
    i, j = g.index(L, "i"), g.index(d, "j")

    def norm(U: Tensor, n: int, out: str) -> normalization.Normalized:
        with g.sublayer(f"{NORM_TITLES[config.norm]} {n}"):
            return normalization.normalize(g, U, config.norm, config.eps, config.affine, out,
                                           prefix=f"ln{n}_", suffix=f"_{n}")

    def attend(U: Tensor) -> attention.Attention:
        with g.sublayer("Self-attention"):
            layer = attention.self_attention(g, U, config.heads, config.causal,
                                             config.out_proj)
        external.update(layer.external_shapes)
        return layer

    def feed_forward(U: Tensor) -> ffn.FeedForward:
        with g.sublayer("Feed-forward network"):
            return ffn.feed_forward(g, U, config.activation, config.ffn_bias)

    if config.norm_position == "post":
        layer = attend(X)
        with g.sublayer("Residual connections"):
            U = g.node("U", (i, j), X[i, j] + layer.output[i, j])
        ln1 = norm(U, 1, "Y")
        mlp = feed_forward(ln1.output)
        with g.sublayer("Residual connections"):
            S = g.node("S", (i, j), ln1.output[i, j] + mlp.output[i, j])
        ln2 = norm(S, 2, "Z")
        output = ln2.output
    else:
        ln1 = norm(X, 1, "N_1")
        layer = attend(ln1.output)
        with g.sublayer("Residual connections"):
            Y = g.node("Y", (i, j), X[i, j] + layer.output[i, j])
        ln2 = norm(Y, 2, "N_2")
        mlp = feed_forward(ln2.output)
        with g.sublayer("Residual connections"):
            output = g.node("Z", (i, j), Y[i, j] + mlp.output[i, j])
    params = layer.params + mlp.params + ln1.params + ln2.params
    return output, params, ln1.guards + ln2.guards


def derive(config: Config) -> Derivation:
    """Every group of assignments that the generated modules of ``config`` need."""
    g = Graph()
    external: dict[str, tuple[str, ...]] = {}
    with g.group("forward"):
        X, Z, params, guards = build_network(g, config, external)
    target = g.input("T", (sizes.L, sizes.d), role="target")
    with g.group("loss"), g.sublayer("Loss"):
        ell = losses.build(g, config.loss, Z, target)
    der = Derivation(config, g, X, target, Z, ell, params, guards, external_shapes=external)
    der.groups["forward"] = Group("forward", ())
    der.groups["loss"] = Group("loss", ("forward",))
    forward, loss = g.in_group("forward"), g.in_group("loss")

    tangents: dict[str, calculus.Tangents] = {}
    for var in der.variables:
        v = var.name
        with der.add_group(f"tangent_{v}", ("forward",)):
            tangents[v] = calculus.propagate(g, forward, calculus.seed(g, var), v)
        with der.add_group(f"jacobian_{v}", (f"tangent_{v}",)):
            der.jacobian[v] = g.output(f"jacobian_{v}", tangents[v].of(Z)).name
        with der.add_group(f"loss_tangent_{v}", ("loss", f"tangent_{v}")):
            calculus.propagate(g, loss, tangents[v], v)
        for kind in ("tangent", "jacobian", "loss_tangent"):
            der.group_directions[f"{kind}_{v}"] = (tangents[v].indices, ())

    for first in der.variables:
        for second in der.variables:
            v, w = first.name, second.name
            renamed = _second_direction(g, tangents[v], tangents[w], v == w)
            der.group_directions[f"second_{v}_{w}"] = (
                tangents[v].indices, tuple(renamed[i] for i in tangents[w].indices))
            with der.add_group(f"second_{v}_{w}", (f"tangent_{v}", f"tangent_{w}")):
                both = calculus.propagate_second(g, forward, tangents[v], tangents[w],
                                                 renamed, f"{v}{w}")
                der.output_hessian[v, w] = g.output(f"output_hessian_{v}_{w}",
                                                    both.of(Z)).name

    with der.add_group("adjoints", ("loss",)):
        seed = Expr([Term(sp.Integer(1))]).with_free(())
        adjoints = calculus.propagate_adjoints(g, forward + loss, ell, seed)
    adjoint_assigns = g.in_group("adjoints")

    pairs = [(a, b) for n, a in enumerate(der.params) for b in der.params[n:]]
    pairs.append((X, X))
    for first, second in pairs:
        v, w = first.name, second.name
        renamed = _second_direction(g, tangents[v], tangents[w], v == w)
        requires = ("adjoints", f"loss_tangent_{v}", f"loss_tangent_{w}")
        mean = first is not X
        der.group_directions[f"loss_hessian_{v}_{w}"] = (
            tangents[v].indices, tuple(renamed[i] for i in tangents[w].indices))
        blocks = {}
        with der.add_group(f"loss_hessian_{v}_{w}", requires):
            for part, assigns in (("gauss_newton", loss), ("functional", forward)):
                blocks[part] = calculus.hessian_by_adjoints(g, assigns, adjoints, tangents[v],
                                                            tangents[w], renamed)
                der.loss_hessian[v, w, part] = g.output(
                    f"{part}_{v}_{w}", blocks[part], mean_over_batch=mean).name
        # the whole block as one node too: its terms then share their products (one
        # contraction where the two parts each had their own)
        der.group_directions[f"loss_hessian_full_{v}_{w}"] = (
            der.group_directions[f"loss_hessian_{v}_{w}"])
        with der.add_group(f"loss_hessian_full_{v}_{w}", requires):
            gauss_newton = blocks["gauss_newton"]
            whole = (gauss_newton + blocks["functional"]).with_free(gauss_newton.free)
            der.loss_hessian_full[v, w] = g.output(f"full_{v}_{w}", whole,
                                                   mean_over_batch=mean).name

    program = forward + loss + adjoint_assigns
    for label, variables in (("params", der.params), ("X", [X])):
        if not variables:
            continue
        with der.add_group(f"hvp_{label}", ("adjoints",)):
            directions = calculus.Tangents(())
            for var in variables:
                direction = g.input(f"v_{var.name}", var.shape, role="direction",
                                    batched=var is X)
                der.directions[var.name] = direction.name
                directions.by_name[var.name] = direction[var.indices].with_free(var.indices)
            calculus.propagate(g, program, directions, f"v{label}")
            for var in variables:
                gradient = adjoints[var.name]
                hv = calculus.differentiate(g, gradient, directions)
                der.hvp[var.name] = g.output(f"hvp_{var.name}", hv,
                                             mean_over_batch=var is not X).name
    return der


def _second_direction(g: Graph, first: calculus.Tangents, second: calculus.Tangents,
                      same: bool) -> dict:
    """Index map for the second direction: fresh indices when both directions are the
    same variable (so the two slots of a diagonal block stay distinct)."""
    if not same:
        return {i: i for i in second.indices}
    return {i: g.index(i.dim, "q") for i in second.indices}
