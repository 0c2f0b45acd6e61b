"""``curvgap bench --models``: ``curvgap.curvature`` on whole models at the sizes users study,
against plain autograd on the same module, in one process, routes interleaved.

Per model and dtype: the time of curvgap's gradient, HVP and Gauss–Newton product against a
backward pass, double backward (MATH attention kernel) and ``torch.func`` jvp + vjp through
the loss's curvature — as ratios ``autograd time / curvgap time`` (above 1: curvgap is
faster) —, the peak memory each adds above what the process holds (Linux: the peak resident
set, reset before each route), and curvgap's relative error against each autograd result.
With curvlinops installed, the Gauss–Newton product also against curvlinops'
``GGNLinearOperator`` matvec on the same module, once as a single product and once as a
product of curvgap's operator at the point (``hessian_operator(..., part="gauss_newton")``,
which keeps the point's forward values between products, as an iterative solver uses it).
Then the top Hessian eigenvalue by ``scipy``'s ``eigsh`` on
``hessian_operator(...).to_scipy()`` against ``eigsh`` on double-backward products, and a
language model's exact diagonal against autograd's and Hutchinson's (:mod:`.diagonal`).

Weights are random (no downloads). ``--quick`` runs every row at tiny sizes (a smoke test);
``--device cuda`` runs them on a GPU (times after the device has finished, memory as torch's
peak allocation there); ``--fused`` runs curvgap's code through ``torch.compile``
(``curvature(..., fused=True)``; its compilation is in each row's warm-up).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._extras import message, require
from ..codegen.output import write_file
from . import diagonal
from .model_routes import Model, Routes, peak_memory, relative_error, synchronized
from .suite import machine


def _randomised(module: torch.nn.Module, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """``module`` in ``dtype``, eval mode, weights ``N(0, 0.02²)`` (norms' around 1)."""
    generator = torch.Generator().manual_seed(seed)
    module = module.to(dtype).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=dtype) * 0.02
            p.copy_(noise + (1.0 if p.ndim == 1 and "weight" in name else 0.0))
    return module


def _gpt2_model(layers: int, d: int, heads: int, L: int, dtype: torch.dtype,
                device: str) -> torch.nn.Module:
    """A ``GPT2Model`` of random weights (eager attention, a small vocabulary it never
    reads: the input is embedded already)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=d, n_layer=layers, n_head=heads, n_positions=L, vocab_size=64,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return _randomised(GPT2Model(config), dtype, 0).to(device)


def gpt2(quick: bool, dtype: torch.dtype, batch: int, device: str = "cpu") -> Model:
    """GPT-2 small (``GPT2Model``: 12 layers, width 768, 12 heads) on ``L = 128`` embedded
    tokens, MSE on the last hidden state."""
    layers, d, heads, L = (2, 16, 2, 8) if quick else (12, 768, 12, 128)
    module = _gpt2_model(layers, d, heads, L, dtype, device)
    X, T = _rows(batch, L, d, dtype, device)
    return Model(f"GPT-2 small, L={L}, B={batch}" if not quick else "GPT-2 (tiny)", module, None,
                 T, inputs={"inputs_embeds": X, "use_cache": False})


def gpt2_lm(quick: bool, dtype: torch.dtype, batch: int, device: str = "cpu") -> Model:
    """GPT-2 small with its language-model head (``GPT2LMHeadModel``: the 50257-word head
    tied to the token table) on ``L = 128`` token ids, next-token cross-entropy."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, d, heads, L, V = (2, 16, 2, 8, 40) if quick else (12, 768, 12, 128, 50257)
    config = GPT2Config(n_embd=d, n_layer=layers, n_head=heads, n_positions=L + 1,
                        vocab_size=V, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")
    module = _randomised(GPT2LMHeadModel(config), dtype, 0).to(device)
    ids = torch.randint(0, V, (batch, L + 1), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    name = f"GPT-2 small LM (tied head), L={L}, B={batch}" if not quick else "GPT-2 LM (tiny)"
    return Model(name, module, ids[:, :-1], ids[:, 1:], loss="cross_entropy",
                 inputs={"use_cache": False}, curvlinops=False)


def _rows(batch: int, L: int, d: int, dtype: torch.dtype, device: str) -> tuple:
    """An input and a target of ``batch`` samples of ``L`` rows of width ``d``."""
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randn(batch, L, d, generator=generator, dtype=dtype).to(device)
                 for _ in range(2))


def llama_layer(quick: bool, dtype: torch.dtype, batch: int, device: str = "cpu") -> Model:
    """A Llama decoder layer at hidden 2048 (16 query heads, 4 key–value heads, SwiGLU of
    5632), ``L = 64``, MSE."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    d, heads, groups, d_ff, L = (16, 4, 2, 24, 8) if quick else (2048, 16, 4, 5632, 64)
    config = LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=groups,
                         intermediate_size=d_ff, attn_implementation="eager")
    module = _randomised(LlamaDecoderLayer(config, layer_idx=0), dtype, 0).to(device)
    X, T = _rows(batch, L, d, dtype, device)
    positions = torch.arange(L, device=device)[None].expand(batch, L)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(X, positions)
    return Model(f"Llama layer 2048, L={L}, B={batch}" if not quick else "Llama layer (tiny)",
                 module, X, T, inputs={"position_embeddings": (cos.to(dtype), sin.to(dtype))})


class ViT(torch.nn.Module):
    """ViT-B/16's trunk on embedded patches: ``depth`` pre-LN GELU encoder layers (width
    ``d``, ``heads``, MLP ``4d``), a final LayerNorm and a linear head on the class token
    (the first), as timm's ``vit_base_patch16`` computes them after its patch embedding."""

    def __init__(self, depth: int, d: int, heads: int, classes: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
            for _ in range(depth)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(tokens))[:, 0])


def vit(quick: bool, dtype: torch.dtype, batch: int, device: str = "cpu") -> Model:
    """ViT-B/16 at image 64 (16 patches and the class token), 10 classes, cross-entropy."""
    depth, d, heads, tokens = (2, 16, 2, 5) if quick else (12, 768, 12, 17)
    # training mode (with no dropout): eval mode takes torch's fused fast path, which
    # torch.func's forward mode cannot run
    module = _randomised(ViT(depth, d, heads, 10), dtype, 0).train().to(device)
    X, _ = _rows(batch, tokens, d, dtype, device)
    T = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1)).to(device)
    return Model(f"ViT-B/16, image 64, B={batch}" if not quick else "ViT (tiny)", module, X, T,
                 loss="cross_entropy")


#: ``(maker, dtype, batch)`` of the table's rows.
ROWS = [(gpt2, torch.float32, 1), (gpt2, torch.float64, 1), (gpt2, torch.float32, 4),
        (gpt2_lm, torch.float32, 1), (gpt2_lm, torch.float64, 1),
        (llama_layer, torch.float64, 2), (vit, torch.float32, 4)]
QUICK_ROWS = [(gpt2, torch.float64, 2), (gpt2_lm, torch.float64, 2),
              (llama_layer, torch.float64, 2), (vit, torch.float32, 2)]


#: ``(key, curvgap's route, the route it is compared with)`` of a row's ratios and errors.
PAIRS = [("gradient", "gradient", "backward"), ("hvp", "hvp", "double_backward"),
         ("gnvp", "gnvp", "jvp_vjp")]
#: The same, against curvlinops (when it is installed).
CURVLINOPS_PAIRS = [("gnvp_curvlinops", "gnvp", "curvlinops_ggn"),
                    ("gn_operator_curvlinops", "gn_operator", "curvlinops_ggn")]


def _pairs(model: Model) -> list[tuple[str, str, str]]:
    try:
        import curvlinops  # noqa: F401
    except ImportError:
        return PAIRS
    return PAIRS + CURVLINOPS_PAIRS if model.curvlinops else PAIRS


def measure(model: Model, rounds: int, device: str = "cpu", fused: bool = False) -> dict:
    """One model's row: times (median of ``rounds``, routes interleaved), ratios, peak
    memory and agreement (curvgap's code through ``torch.compile`` when ``fused``)."""
    routes = Routes(model, fused)
    pairs = _pairs(model)
    names = dict.fromkeys(name for _, ours, theirs in pairs for name in (ours, theirs))
    run = {name: synchronized(getattr(routes, name), device) for name in names}
    start = time.perf_counter()
    results = {name: fn() for name, fn in run.items()}  # the warm-up (and first use)
    first_use = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(rounds):
        for name, fn in run.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    memory = {name: peak_memory(fn, device) for name, fn in run.items()}
    return {
        "model": model.name, "dtype": str(next(iter(routes.params.values())).dtype)[6:],
        "parameters": routes.v.numel(), "seconds": median,
        "ratio": {key: median[theirs] / median[ours] for key, ours, theirs in pairs},
        "peak_memory_gb": memory,
        "relative_error": {key: relative_error(results[ours], results[theirs])
                           for key, ours, theirs in pairs},
        "warm_up_seconds": first_use, "device": device, "fused": fused}


def eigenvalue(quick: bool, device: str = "cpu", fused: bool = False) -> dict | None:
    """The top Hessian eigenvalue of a 2-layer GPT-2 (width 128, ``L = 16``) by ``eigsh`` on
    curvgap's operator, on double-backward products and on double backward through one
    kept gradient graph (PyHessian's way), each timed after one product (its first use);
    None without scipy."""
    try:
        from scipy.sparse.linalg import LinearOperator, eigsh
    except ImportError:
        return None
    d, L = (16, 8) if quick else (128, 16)
    module = _gpt2_model(2, d, 2 if quick else 4, L, torch.float64, device)
    X, T = _rows(2, L, d, torch.float64, device)
    routes = Routes(Model("GPT-2, 2 layers", module, None, T,
                          inputs={"inputs_embeds": X, "use_cache": False}), fused)
    n = routes.v.numel()
    operator = routes.curvature.hessian_operator(None, T, inputs_embeds=X,
                                                 use_cache=False).to_scipy()

    def autograd(product: Callable[[torch.Tensor], torch.Tensor]) -> LinearOperator:
        return LinearOperator((n, n), dtype="float64", matvec=lambda u: product(
            torch.as_tensor(u.reshape(-1), dtype=torch.float64, device=device)).cpu().numpy())

    out = {"model": f"GPT-2, 2 layers, width {d}, L={L}, B=2", "parameters": n}
    for name, op in (("curvgap", operator), ("double_backward", autograd(routes.double_backward)),
                     ("retained_graph", autograd(routes.retained_double_backward()))):
        op.matvec(torch.ones(n, dtype=torch.float64).numpy())  # first use (fused: compiling)
        start = time.perf_counter()
        value = eigsh(op, k=1, which="LM", v0=torch.ones(n, dtype=torch.float64).numpy(),
                      return_eigenvectors=False)[0]
        out[name] = {"eigenvalue": float(value), "seconds": time.perf_counter() - start}
    out["ratio"] = out["double_backward"]["seconds"] / out["curvgap"]["seconds"]
    out["ratio_retained"] = out["retained_graph"]["seconds"] / out["curvgap"]["seconds"]
    return out


def _line(row: dict) -> str:
    s, r, m, e = row["seconds"], row["ratio"], row["peak_memory_gb"], row["relative_error"]
    memory = ("   n/a" if m["hvp"] is None or m["double_backward"] is None else
              f"{m['hvp']:6.2f} vs {m['double_backward']:5.2f}")
    return (f"  {row['model']:<30} {row['dtype']:<8} {row['parameters']:>11,}  "
            f"{s['gradient']:7.3f} {s['hvp']:7.3f} {s['gnvp']:7.3f}   "
            f"{s['backward']:7.3f} {s['double_backward']:7.3f} {s['jvp_vjp']:7.3f}   "
            f"{r['gradient']:5.2f} {r['hvp']:5.2f} {r['gnvp']:5.2f}   {memory}   "
            f"{max(e.values()):.1e}"
            + (f"   curvlinops {s['curvlinops_ggn']:7.3f}, kept-point operator "
               f"{s['gn_operator']:7.3f}: {r['gnvp_curvlinops']:5.2f} "
               f"{r['gn_operator_curvlinops']:5.2f}" if "gnvp_curvlinops" in r else ""))


def _ratio(ratios: dict, key: str) -> str:
    return f"{ratios[key]:.2f}×" if key in ratios else "n/a"


def markdown(results: dict) -> str:
    """The run's table in Markdown (as the README shows it): per model and dtype the ratios
    ``autograd time / curvgap time`` (curvlinops' time for its columns; n/a in a run without
    curvlinops), the peak memory of the HVP against double backward,
    and the largest relative error; for a fused run the first calls' time; the eigenvalue's
    line and the exact diagonal's last."""
    lines = ["| model | dtype | parameters | gradient vs backward | HVP vs double backward | "
             "GN product vs jvp + vjp | GN product vs curvlinops' GGN matvec | GN operator "
             "product at a kept point vs curvlinops' | peak memory, HVP vs double backward | "
             "largest relative error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["rows"]:
        r, m = row["ratio"], row["peak_memory_gb"]
        memory = ("n/a" if m["hvp"] is None or m["double_backward"] is None
                  else f"{m['hvp']:.2f} GB vs {m['double_backward']:.2f} GB")
        lines.append(f"| {row['model']} | {row['dtype']} | {row['parameters']:,} | "
                     f"{r['gradient']:.2f}× | {r['hvp']:.2f}× | {r['gnvp']:.2f}× | "
                     f"{_ratio(r, 'gnvp_curvlinops')} | {_ratio(r, 'gn_operator_curvlinops')} | "
                     f"{memory} | "
                     f"{max(row['relative_error'].values()):.1e} |")
    if results.get("fused"):
        first = [row["warm_up_seconds"] for row in results["rows"]]
        lines.append("")
        lines.append(f"First calls (each route once; curvgap's compiling for these sizes, or "
                     f"reading torch's compile cache of an earlier run): "
                     f"{min(first):.0f}–{max(first):.0f} s a row.")
    top = results["eigenvalue"]
    if top is not None:
        lines.append("")
        lines.append(f"Top Hessian eigenvalue of {top['model']} by `eigsh`: "
                     f"{top['curvgap']['seconds']:.2f} s on `hessian_operator(...).to_scipy()` "
                     f"against {top['double_backward']['seconds']:.2f} s on double backward "
                     f"({top['ratio']:.2f}×)"
                     + (f" and {top['retained_graph']['seconds']:.2f} s on double backward "
                        f"through one kept gradient graph ({top['ratio_retained']:.2f}×)"
                        if "retained_graph" in top else "")
                     + f", the same eigenvalue to {_relative_scalar(top):.0e}.")
    if results.get("diagonal") is not None:
        lines.append("")
        lines.append(diagonal.line(results["diagonal"]))
    return "\n".join(lines)


def _relative_scalar(top: dict) -> float:
    a, b = top["curvgap"]["eigenvalue"], top["double_backward"]["eigenvalue"]
    return max(abs(a - b) / abs(b), 1e-16)


def run_models(quick: bool, out: Path, device: str = "cpu", fused: bool = False) -> dict:
    """Measure every row of :data:`ROWS` (:data:`QUICK_ROWS` when ``quick``) and the
    eigenvalue (curvgap's code through ``torch.compile`` when ``fused``), print the table,
    write ``models.json`` into ``out`` (:class:`ImportError` naming the ``transformers``
    extra, before any work, without transformers)."""
    require("transformers", "curvgap bench --models", "transformers")
    rounds = 1 if quick else 3
    where = (f"{torch.get_num_threads()} threads" if device == "cpu" else
             torch.cuda.get_device_name(device))
    print(f"curvgap bench --models ({'tiny sizes' if quick else 'real sizes'}; {where}; "
          f"{'fused; ' if fused else ''}median of {rounds}, routes interleaved)")
    print("  times in seconds: curvgap gradient / HVP / GN product, autograd backward / "
          "double backward / torch.func jvp+vjp; ratios autograd/curvgap (above 1: curvgap "
          "faster); peak extra memory GB of the HVP vs double backward; largest relative "
          "error; with curvlinops, its GGN matvec's time and the ratios over it of the GN "
          "product and of the GN operator's product at a kept point", flush=True)
    rows = []
    for maker, dtype, batch in QUICK_ROWS if quick else ROWS:
        model = maker(quick, dtype, batch, device)
        print(f"  … {model.name} ({str(dtype)[6:]})", file=sys.stderr, flush=True)
        rows.append(measure(model, rounds, device, fused))
        print(_line(rows[-1]), flush=True)
    print("  … the top Hessian eigenvalue by eigsh", file=sys.stderr, flush=True)
    top = eigenvalue(quick, device, fused)
    if top is None:
        print(f"  eigenvalue: skipped ({message(['scipy'], 'eigsh', 'operators')})")
    else:
        print(f"  top eigenvalue of {top['model']} ({top['parameters']:,} parameters): curvgap "
              f"{top['curvgap']['eigenvalue']:.12g} in {top['curvgap']['seconds']:.2f} s, "
              f"double backward {top['double_backward']['eigenvalue']:.12g} in "
              f"{top['double_backward']['seconds']:.2f} s (ratio {top['ratio']:.2f}), on a "
              f"kept gradient graph in {top['retained_graph']['seconds']:.2f} s (ratio "
              f"{top['ratio_retained']:.2f})")
    exact = None
    if not fused:  # (the diagonal's code is not compiled: a fused run would repeat it)
        print("  … the exact diagonal against Hutchinson's estimate", file=sys.stderr,
              flush=True)
        exact = diagonal.exact_diagonal(quick, device, functools.partial(peak_memory,
                                                                        device=device))
        print(f"  {diagonal.line(exact)}", flush=True)
    results: dict[str, Any] = {"machine": machine(), "device": where, "quick": quick,
                               "fused": fused, "rows": rows, "eigenvalue": top,
                               "diagonal": exact}
    Path(out).mkdir(parents=True, exist_ok=True)
    write_file(Path(out) / "models.json", json.dumps(results, indent=1) + "\n")
    return results
