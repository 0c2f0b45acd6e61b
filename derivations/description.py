"""A config's (or a program's) architecture in words and equations (the docstring of its
generated modules and the opening of its document), from each sublayer's own line."""

from __future__ import annotations

from . import attention, embedding, ffn, head, normalization, program
from .config import Config
from .program import Program


def describe(config: Config | Program) -> tuple[str, str]:
    """A title and the architecture as equations, from the config or the program read from a
    module (for docstrings)."""
    if isinstance(config, Program):
        return program.describe(config)
    loss = f"loss: {config.loss} per sample, averaged over the batch"
    if config.kind == "layernorm":
        title = f"{normalization.title(config)} of each row of X"
        norm = normalization.describe(config, "X").removeprefix("Norm(X) = ")
        lines = [f"Z = {norm}", loss]
    elif config.kind == "self_attention":
        title = attention.TITLE
        lines = [attention.describe(config), loss]
    elif config.kind == "embedding":
        title = embedding.TITLE
        lines = [embedding.describe(config), loss]
    elif config.kind == "head":
        title = head.TITLE
        lines = [head.describe(config), loss]
    elif config.kind == "ffn":
        title = ffn.TITLE
        lines = [ffn.describe(config, "X"), loss]
    else:
        title = (f"{config.norm_position.capitalize()}-{normalization.title(config)} "
                 "Transformer block")
        a, f = ("lambda_1 * F", "lambda_2 * FFN") if config.layer_scale else ("F", "FFN")
        if config.norm_position == "post":
            block = "Y = Norm_1(X + F(X)), Z = Norm_2(Y + FFN(Y))"
        elif config.norm_position == "parallel":
            second = "Norm_1" if config.shared_norm else "Norm_2"
            block = (f"Z = X + {a}(Norm_1(X)) + {f}({second}(X)) (parallel residual"
                     + (", one norm" if config.shared_norm else "") + ")")
        else:
            block = f"Y = X + {a}(Norm_1(X)), Z = Y + {f}(Norm_2(Y))"
        if config.sandwich_norm:
            block += ", each branch's output normalised (Norm_3 after F, Norm_4 after FFN)"
        if config.layer_scale:
            block += ", lambda_1, lambda_2 learned per channel (LayerScale)"
        crossing = []
        if config.cross_attention:
            block = block.replace("Y)", "Y_c)").replace("(Y +", "(Y_c +").replace(
                "Z = Y +", "Z = Y_c +")
            block += (", Y_c = Norm_3(Y + F_c(Y))" if config.norm_position == "post"
                      else ", Y_c = Y + F_c(Norm_3(Y))")
            crossing = [attention.describe(attention.crossed(config), "_c")]
        lines = [block, attention.describe(attention.own(config)), *crossing,
                 ffn.describe(config), normalization.describe(config), loss]
    return f"{title}: exact Jacobians, Hessians and Hessian-vector products.", "\n".join(lines)


#: What each term does to the Kronecker structure of the blocks and to the paper's objects.
TERM_NOTES = {
    "rotary": "rotary embeddings turn Q and K by a different angle at each position, so a "
              "block through W_Q or W_K is no single Kronecker product per sample",
    "relative_bias": "T5's relative position bias adds a learned table per offset to the "
                     "scores: the paper's score-level objects gain its blocks",
    "logit_softcap": "soft-capping puts cap * tanh(T / cap) between the scores and the "
                     "softmax: the paper's score-level objects gain its derivatives",
    "layer_scale": "LayerScale multiplies each branch by a learned vector, a factor inside "
                   "every block of that branch",
    "parallel": "the parallel residual adds both branches to X: the paper's chain Y = "
                "Norm(X + F(X)), Z = Norm(Y + FFN(Y)) does not apply",
    "sandwich_norm": "the branch outputs pass a norm of their own before the residual sum",
    "kv_heads": "grouped-query heads share W_K, W_V: their blocks sum over the query heads",
    "pooled_norm": "the pooled row is normalised, a non-linear map between X and W_H",
    "pooler": "the pooler's tanh sits between the pooled row and W_H",
    "cross_attention": "cross-attention takes its keys and values from a second input M, "
                       "held constant: its blocks are those of an attention whose keys and "
                       "values do not move with X",
}


def structure(config: Config | Program, structured: list[tuple[str, str, str]]) -> str:
    """A paragraph for the module's docstring: which loss-Hessian blocks over two matrix
    parameters are exactly a sum of Kronecker products (``structured``: ``(V, W, part)``),
    and which of the config's terms break that structure or change the paper's objects."""
    blocks: dict[tuple[str, str], list[str]] = {}
    for v, w, part in structured:
        blocks.setdefault((v, w), []).append(part.replace("_", "-"))
    if blocks:
        listed = "; ".join(f"({v}, {w}): {', '.join(parts)}" for (v, w), parts in blocks.items())
        text = ("Kronecker structure (read off the index form): exactly a sum of Kronecker "
                f"products per sample ({listed}), factors from ``kronecker_factors``; every "
                "other block is not.")
    else:
        text = ("Kronecker structure (read off the index form): no loss-Hessian block is "
                "exactly a sum of Kronecker products here.")
    if isinstance(config, Program):
        return text
    present = [key for key in TERM_NOTES if TERM_NOTES[key] and _has(config, key)]
    if present:
        text += " Here " + "; ".join(TERM_NOTES[key] for key in present) + "."
    return text


def _has(config: Config, term: str) -> bool:
    if term == "parallel":
        return config.kind == "block" and config.norm_position == "parallel"
    return bool(getattr(config, term, False))
