"""A config's architecture in words and equations (the docstring of its generated modules and
the opening of its document)."""

from __future__ import annotations

from .config import Config


def describe(config: Config) -> tuple[str, str]:
    """A title and the architecture as equations, from the config (for docstrings)."""
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[config.norm]
    if config.norm == "layernorm":
        norm_formula = "(U - mean(U)) / sqrt(var(U) + eps)"
    else:
        norm_formula = "U / sqrt(mean(U**2) + eps)"
    if config.affine:
        norm_formula += " * gamma" + (" + beta" if config.norm == "layernorm" else "")
    heads = (f"{config.heads} heads (W_Q, W_K, W_V split by columns, concatenated)"
             if config.heads > 1 else "one head")
    attention = ("F(X) = softmax(X W_Q W_K^T X^T / sqrt(d_k)"
                 + (" + causal mask" if config.causal else "") + ") X W_V"
                 + (" W_O" if config.out_proj else "") + f", {heads}")
    bias = (" + b_1", " + b_2") if config.ffn_bias else ("", "")
    ffn = f"FFN(Y) = {config.activation}(Y W_1{bias[0]}) W_2{bias[1]}"
    normalization = f"Norm(U) = {norm_formula} per row, eps = {config.eps!r}"
    loss = f"loss: {config.loss} per sample, averaged over the batch"
    if config.kind == "layernorm":
        title = f"{norm} of each row of X"
        lines = [f"Z = {normalization.replace('Norm(U) = ', '').replace('U', 'X')}", loss]
    elif config.kind == "self_attention":
        title = "Self-attention"
        lines = [attention, loss]
    elif config.kind == "ffn":
        title = "Feed-forward network"
        lines = [ffn.replace("Y", "X"), loss]
    else:
        title = f"{config.norm_position.capitalize()}-{norm} Transformer block"
        if config.norm_position == "post":
            block = "Y = Norm_1(X + F(X)), Z = Norm_2(Y + FFN(Y))"
        else:
            block = "Y = X + F(Norm_1(X)), Z = Y + FFN(Norm_2(Y))"
        lines = [block, attention, ffn, normalization, loss]
    return f"{title}: exact Jacobians, Hessians and Hessian-vector products.", "\n".join(lines)
