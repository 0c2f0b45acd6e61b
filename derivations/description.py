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
        if config.norm_position == "post":
            block = "Y = Norm_1(X + F(X)), Z = Norm_2(Y + FFN(Y))"
        else:
            block = "Y = X + F(Norm_1(X)), Z = Y + FFN(Norm_2(Y))"
        lines = [block, attention.describe(config), ffn.describe(config),
                 normalization.describe(config), loss]
    return f"{title}: exact Jacobians, Hessians and Hessian-vector products.", "\n".join(lines)
