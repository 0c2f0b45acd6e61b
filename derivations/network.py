"""A config's network: the forward graph of its sublayer (an embedding, a head, a norm,
self-attention, a feed-forward network) or of its block (the sublayers composed post-LN,
pre-LN or in parallel, with the options of :class:`~curvgap.derivations.config.Config`),
each sublayer derived by its own module."""

from __future__ import annotations

from . import attention, embedding, ffn, head, normalization, sizes
from .config import Config
from .graph import Graph, Guard, Tensor
from .indexform import Expr


def build_network(g: Graph, config: Config, external: dict | None = None
                   ) -> tuple[Tensor, Tensor, list[Tensor], list[Guard]]:
    """The forward nodes of the configured sublayer: input ``X``, output, parameters in
    the toolkit's order (``W_Q, W_K, W_V, W_O, W_1, b_1, W_2, b_2, gamma_1, beta_1,
    gamma_2, beta_2``, those present; an embedding's ``W_E, b_E, c_E, P_E``, a head's
    ``W_H, b_H``), and runtime guards; ``external`` collects the shapes
    users pass where they differ from the engine's."""
    external = {} if external is None else external
    features = sizes.p if config.kind == "embedding" and config.projection else sizes.d
    X = g.input("X", (sizes.L, features))
    if config.kind == "embedding":
        with g.sublayer(embedding.TITLE):
            layer = embedding.embed(g, X, config)
        return X, layer.output, layer.params, []
    if config.kind == "head":
        with g.sublayer(head.TITLE):
            layer = head.head(g, X, config)
        return X, layer.output, layer.params, layer.guards
    if config.kind == "layernorm":
        with g.sublayer(normalization.title(config)):
            norm = normalization.normalize(g, X, config, "Z")
        return X, norm.output, norm.params, norm.guards
    if config.kind == "self_attention":
        with g.sublayer(attention.TITLE):
            layer = attention.self_attention(g, X, config)
        external.update(layer.external_shapes)
        return X, layer.output, layer.params, []
    if config.kind == "ffn":
        with g.sublayer(ffn.TITLE):
            layer = ffn.feed_forward(g, X, config, "Z")
        return X, layer.output, layer.params, []
    return (X, *_block(g, config, X, external))


def _block(g: Graph, config: Config, X: Tensor, external: dict
           ) -> tuple[Tensor, list[Tensor], list[Guard]]:
    """Post-LN: ``Y = LN_1(X + F(X))``, ``S = Y + FFN(Y)``, ``Z = LN_2(S)``.
    Pre-LN: ``Y = X + F(LN_1(X))``, ``Z = Y + FFN(LN_2(Y))``.
    Parallel: ``Z = X + F(LN_1(X)) + FFN(LN_2(X))`` (``LN_2 = LN_1`` with ``shared_norm``).
    With ``sandwich_norm`` each branch's output is normalised (``LN_3``, ``LN_4``) and with
    ``layer_scale`` scaled per channel (``λ_1``, ``λ_2``) before it is added. With
    ``cross_attention`` a cross-attention ``F_c(·, M)`` on a second input ``M`` (parameters
    ``W_Q_c, …``) comes between the two, with its own norm ``LN_3``: post-LN
    ``Y_c = LN_3(Y + F_c(Y))`` feeds the FFN; pre-LN ``Y_c = Y + F_c(LN_3(Y))``."""
    L, d = sizes.L, sizes.d
    i, j = g.index(L, "i"), g.index(d, "j")

    def norm(U: Tensor, n: int, out: str) -> normalization.Normalized:
        with g.sublayer(f"{normalization.title(config)} {n}"):
            return normalization.normalize(g, U, config, out, prefix=f"ln{n}_",
                                           suffix=f"_{n}")

    def attend(U: Tensor) -> attention.Attention:
        with g.sublayer(attention.TITLE):
            layer = attention.self_attention(g, U, attention.own(config))
        external.update(layer.external_shapes)
        return layer

    def feed_forward(U: Tensor) -> ffn.FeedForward:
        with g.sublayer(ffn.TITLE):
            return ffn.feed_forward(g, U, config)

    def cross(Y: Tensor, post: bool) -> tuple[Tensor, list[Tensor], list]:
        """``Y`` through the cross-attention, its residual and its norm ``LN_3`` (after the
        sum post-LN, before the sublayer pre-LN): ``(output, parameters, norms)``; ``Y``
        itself without ``cross_attention``."""
        if not config.cross_attention:
            return Y, [], []
        ln3 = None if post else norm(Y, 3, "N_3")
        with g.sublayer(attention.CROSS_TITLE):
            layer = attention.self_attention(g, Y if post else ln3.output,
                                             attention.crossed(config), "F_c", "_c")
        external.update(layer.external_shapes)
        with g.sublayer("Residual connections"):
            U_c = g.node("U_c" if post else "Y_c", (i, j), Y[i, j] + layer.output[i, j])
        if post:
            ln3 = norm(U_c, 3, "Y_c")
            return ln3.output, layer.params, [ln3]
        return U_c, layer.params, [ln3]

    if config.norm_position == "post":
        layer = attend(X)
        with g.sublayer("Residual connections"):
            U = g.node("U", (i, j), X[i, j] + layer.output[i, j])
        ln1 = norm(U, 1, "Y")
        Y, crossed, crossed_norms = cross(ln1.output, post=True)
        mlp = feed_forward(Y)
        with g.sublayer("Residual connections"):
            S = g.node("S", (i, j), Y[i, j] + mlp.output[i, j])
        ln2 = norm(S, 2, "Z")
        output = ln2.output
    else:
        scales = ([g.input(f"lambda_{k}", (d,), role="param", batched=False) for k in (1, 2)]
                  if config.layer_scale else [])

        sandwiches: list[normalization.Normalized] = []

        def branch(out: Tensor, k: int) -> Expr:
            """A branch's output: normalised with ``sandwich_norm`` (norm ``k + 2``), scaled
            per channel with ``layer_scale``."""
            if config.sandwich_norm:
                sandwiches.append(norm(out, k + 2, f"N_{k + 2}"))
                out = sandwiches[-1].output
            return scales[k - 1][j] * out[i, j] if scales else out[i, j]

        ln1 = norm(X, 1, "N_1")
        layer = attend(ln1.output)
        if config.norm_position == "parallel":
            ln2 = ln1 if config.shared_norm else norm(X, 2, "N_2")
            mlp = feed_forward(ln2.output)
            with g.sublayer("Residual connections"):
                output = g.node("Z", (i, j), X[i, j] + branch(layer.output, 1)
                                + branch(mlp.output, 2))
        else:
            with g.sublayer("Residual connections"):
                Y = g.node("Y", (i, j), X[i, j] + branch(layer.output, 1))
            Y, crossed, crossed_norms = cross(Y, post=False)
            ln2 = norm(Y, 2, "N_2")
            mlp = feed_forward(ln2.output)
            with g.sublayer("Residual connections"):
                output = g.node("Z", (i, j), Y[i, j] + branch(mlp.output, 2))
        if config.norm_position == "parallel":
            crossed, crossed_norms = [], []
        norms = [ln1] if ln2 is ln1 else [ln1, ln2]  # one norm: its parameters once
        norms += sandwiches + crossed_norms
        params = (layer.params + crossed + mlp.params + [p for n in norms for p in n.params]
                  + scales)
        return output, params, [guard for n in norms for guard in n.guards]
    norms = [ln1, ln2, *crossed_norms]
    params = layer.params + crossed + mlp.params + [p for n in norms for p in n.params]
    return output, params, [guard for n in norms for guard in n.guards]
