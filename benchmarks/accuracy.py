"""``curvgap bench --accuracy``: how far the numeric tools users reach for are from the exact
Hessian on common Transformer layers, beside curvgap.

For each layer (built from its library's config class, random nonzero weights, float64,
eval mode, ``L = 5``, ``d = 8``, two heads, ``d_ff = 12``, a batch of 2), under the MSE loss
on its output, the error ``max |H v − H_ref v| / max |H_ref v|`` of the Hessian-vector
product against reverse-over-reverse autograd on the layer (MATH attention kernel; on its
float64 twin where the library computes in float32 inside, :mod:`.twin`), for

* curvgap (``curvgap.curvature(layer).hvp``),
* ``torch.func``: ``jvp`` of ``grad`` (forward over reverse), and ``torch.func.hessian``,
* curvlinops' ``HessianLinearOperator`` (when installed),

and the full Hessian's error for ``torch.func.hessian``. A tool that cannot run the layer is
reported with its error. Results go to ``accuracy.json`` and a Markdown table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._extras import missing
from .twin import float64_twin

B, L, D, HEADS, D_FF = 2, 5, 8, 2, 12
DTYPE = torch.float64


def _randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.copy_(noise * 0.7 + (0.5 if p.ndim == 1 else 0.0))
    return module.to(DTYPE).eval()


class LinearLayerNorm(torch.nn.Module):
    """``LayerNorm(X W^T + b)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, D)
        self.norm = torch.nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


class _Bound(torch.nn.Module):
    """A layer with keyword inputs bound (for tools that call ``module(X)``)."""

    def __init__(self, module: torch.nn.Module, inputs: dict) -> None:
        super().__init__()
        self.module, self.inputs = module, inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x, **self.inputs)
        return out[0] if isinstance(out, tuple) else out


def layers() -> dict[str, Callable[[torch.Tensor], tuple[torch.nn.Module, dict]]]:
    """Each layer by name: a builder taking ``X`` and giving the layer and its keyword
    inputs."""
    def encoder(norm_first: bool) -> Callable:
        return lambda X: (_randomised(torch.nn.TransformerEncoderLayer(
            D, HEADS, D_FF, batch_first=True, norm_first=norm_first)), {})

    out = {"Linear → LayerNorm": lambda X: (_randomised(LinearLayerNorm()), {}),
           "TransformerEncoderLayer (post-LN)": encoder(False),
           "TransformerEncoderLayer (pre-LN)": encoder(True)}
    try:
        import transformers
    except ImportError:
        return out
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    def llama(X: torch.Tensor) -> tuple[torch.nn.Module, dict]:
        config = transformers.LlamaConfig(hidden_size=D, num_attention_heads=2 * HEADS,
                                          num_key_value_heads=HEADS, intermediate_size=D_FF)
        config._attn_implementation = "sdpa"
        rotary = LlamaRotaryEmbedding(config).to(DTYPE)
        tables = rotary(X, torch.arange(X.shape[1])[None].expand(X.shape[0], -1))
        return (_randomised(LlamaDecoderLayer(config, layer_idx=0)),
                {"position_embeddings": tuple(t.to(DTYPE) for t in tables)})

    def hf(cls: type, config: Any) -> Callable:
        config._attn_implementation = "sdpa"
        return lambda X: (_randomised(cls(config)), {})

    out["BertLayer"] = hf(BertLayer, transformers.BertConfig(
        hidden_size=D, num_attention_heads=HEADS, intermediate_size=D_FF))
    out["GPT2Block"] = hf(GPT2Block, transformers.GPT2Config(n_embd=D, n_head=HEADS,
                                                               n_inner=D_FF))
    out["LlamaDecoderLayer (SiLU)"] = llama
    return out


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


def measure(layer: torch.nn.Module, inputs: dict, X: torch.Tensor, T: torch.Tensor,
            v: torch.Tensor) -> dict[str, float | str]:
    """The errors of each tool's Hessian-vector product (and ``torch.func.hessian``'s
    Hessian) for ``layer`` against reverse over reverse."""
    import curvgap

    bound = _Bound(layer, inputs)
    params = dict(bound.named_parameters())  # the layer's, in its order ("module." first)
    marked = X.detach().requires_grad_(True)  # on the path: the twin keeps it in float64

    def loss(p: dict, X: torch.Tensor = X) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(bound, p, (X,)), T)

    with sdpa_kernel(SDPBackend.MATH), float64_twin():
        gradient = _flat(torch.autograd.grad(loss(params, marked), list(params.values()),
                                             create_graph=True))
        reference = _flat(torch.autograd.grad(gradient @ v, list(params.values()),
                                              retain_graph=True)).detach()
        H = torch.stack([_flat(torch.autograd.grad(gradient[k], list(params.values()),
                                                   retain_graph=True))
                         for k in range(gradient.numel())]).detach()
    results: dict[str, float | str] = {}
    results["curvgap"] = _error(curvgap.curvature(layer).hvp(X, T, v, **inputs), reference)
    detached = {k: p.detach() for k, p in params.items()}
    flat = _flat(detached.values())

    def flat_loss(theta: torch.Tensor) -> torch.Tensor:
        pieces = theta.split([p.numel() for p in detached.values()])
        return loss({k: piece.reshape(p.shape) for (k, p), piece in
                     zip(detached.items(), pieces)})

    with sdpa_kernel(SDPBackend.MATH):
        try:
            _, hvp = torch.func.jvp(torch.func.grad(flat_loss), (flat,), (v,))
            results["torch.func jvp(grad)"] = _error(hvp, reference)
        except Exception as error:  # noqa: BLE001 - a tool that cannot run the layer
            results["torch.func jvp(grad)"] = _failure(error)
        try:
            results["torch.func.hessian"] = _error(torch.func.hessian(flat_loss)(flat), H)
        except Exception as error:  # noqa: BLE001
            results["torch.func.hessian"] = _failure(error)
    results["curvlinops"] = _curvlinops(bound, X, T, v, reference)
    return results


def _curvlinops(model: torch.nn.Module, X: torch.Tensor, T: torch.Tensor, v: torch.Tensor,
                reference: torch.Tensor) -> float | str:
    try:
        from curvlinops import HessianLinearOperator
    except ImportError:
        return "not installed"
    try:
        with sdpa_kernel(SDPBackend.MATH):
            operator = HessianLinearOperator(model, torch.nn.MSELoss(),
                                             [p for p in model.parameters()], [(X, T)],
                                             check_deterministic=False)
            return _error(operator @ v, reference)
    except Exception as error:  # noqa: BLE001
        return _failure(error)


def _failure(error: Exception) -> str:
    return f"fails: {type(error).__name__}: {str(error).splitlines()[0][:90]}"


def table(results: dict[str, dict[str, float | str]]) -> str:
    """The results as a Markdown table (relative errors of the HVP; ``torch.func.hessian``:
    of the whole Hessian), a tool that fails marked ``fails (k)``, its error listed below."""
    tools = ["curvgap", "torch.func jvp(grad)", "torch.func.hessian", "curvlinops"]
    lines = ["| layer | " + " | ".join(f"`{t}`" if t.startswith("torch") else t
                                       for t in tools) + " |",
             "| --- | " + " | ".join("---:" for _ in tools) + " |"]
    failures: list[str] = []

    def cell(value: float | str) -> str:
        if isinstance(value, float):
            return f"{value:.1e}"
        message = value.removeprefix("fails: ")
        if message not in failures:
            failures.append(message)
        return f"fails ({failures.index(message) + 1})"

    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(cell(row[t]) for t in tools) + " |")
    notes = [f"({k}) {message}" for k, message in enumerate(failures, 1)]
    return "\n".join(lines) + ("\n\n" + "  \n".join(notes) if notes else "")


def run_accuracy(out: Path) -> dict[str, dict[str, float | str]]:
    """Measure every layer, write ``accuracy.json`` under ``out`` and print the table."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(B, L, D, generator=generator, dtype=DTYPE)
    T = torch.randn(B, L, D, generator=generator, dtype=DTYPE)
    for absent in (missing(["transformers"], "the comparison on Hugging Face layers "
                           "(BertLayer, GPT2Block, LlamaDecoderLayer)", "transformers"),
                   missing(["curvlinops"], "the curvlinops column")):
        if absent:
            print(f"  skipped: {absent}", flush=True)
    results = {}
    for name, build in layers().items():
        layer, inputs = build(X)
        n = sum(p.numel() for p in layer.parameters())
        v = torch.randn(n, generator=generator, dtype=DTYPE)
        results[name] = measure(layer, inputs, X, T, v)
        print(f"  {name}: " + ", ".join(f"{k} {val:.1e}" if isinstance(val, float)
                                        else f"{k} {val}" for k, val in results[name].items()),
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return results
