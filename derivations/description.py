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
        lines = [block, attention.describe(config), ffn.describe(config),
                 normalization.describe(config), loss]
    return f"{title}: exact Jacobians, Hessians and Hessian-vector products.", "\n".join(lines)
