"""``curvgap bench --scale``: curvgap where users work, from the headline size to GPT-2 width.

At each size of :data:`SIZES` (``paper_block``, float64, CPU, in one process), as ratios to
the fastest route of the other tools:

* the HVP (``--fused``: also the generated torch module through ``torch.compile``) against
  torch double backward, ``torch.func`` jvp-of-grad, curvlinops'
  ``HessianLinearOperator`` matvec and JAX ``jit(jvp(grad))``;
* the Gauss–Newton-vector product against curvlinops' ``GGNLinearOperator`` matvec and JAX
  ``jit`` (``jvp``, the loss's curvature, ``vjp``);
* the exact diagonal against autograd's exact diagonal (``vmap`` of jvp-of-grad over the
  ``n`` unit vectors, timed whole where ``n`` is small, else on one chunk and scaled to ``n``);
* the structured Gauss–Newton ``W_V``–``W_V`` block of ``self_attention`` as Kronecker
  factors, with its whole spectrum, against the size of its dense form;
* ``curvgap.curvature`` on a real ``nn.TransformerEncoderLayer`` of ViT-B width: its HVP
  against double backward on the layer, its Gauss–Newton product and diagonal;
* the peak memory of a dense block (``loss_hessian`` over ``W_V``) against its size, in a
  fresh process.

JAX rows need ``jax[cpu]``, curvlinops rows curvlinops; each is skipped with a line when
absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.func import grad, jvp, vmap

from .._extras import require
from ..codegen.cache import module_for
from ..codegen.output import write_file
from ..codegen.resources import CONFIGS
from ..codegen.verify import random_case
from ..derivations.config import load
from ..operators import kronecker_block
from . import jax_routes
from .real_layer import LayerRoutes, encoder_layer
from .routes import Routes
from .suite import machine, median_time

#: ``(L, d, d_k, d_ff)`` and the batch: the headline size, two wider, GPT-2's width.
SIZES = [({"L": 16, "d": 16, "d_k": 16, "d_ff": 64}, 32),
         ({"L": 64, "d": 64, "d_k": 64, "d_ff": 256}, 8),
         ({"L": 128, "d": 128, "d_k": 64, "d_ff": 512}, 4),
         ({"L": 128, "d": 768, "d_k": 64, "d_ff": 3072}, 1)]
QUICK_SIZES = [({"L": 4, "d": 6, "d_k": 3, "d_ff": 8}, 2), ({"L": 5, "d": 8, "d_k": 4,
                                                             "d_ff": 6}, 2)]
#: The exact autograd diagonal is timed whole up to this many parameters, else on one chunk
#: of unit vectors (at most 64, and at most 2^24 entries of them).
WHOLE_DIAGONAL = 3000
#: The real layer: a pre-LN GELU ``nn.TransformerEncoderLayer`` of ViT-B / BERT-base width
#: (d, heads, d_ff), L, B; and the quick run's.
REAL_LAYER, QUICK_REAL_LAYER = ((768, 12, 3072), 128, 1), ((16, 2, 32), 8, 2)
#: Dense blocks whose peak memory is measured: (L, d, d_k, d_ff), batch.
MEMORY_SIZES = [({"L": 64, "d": 64, "d_k": 64, "d_ff": 256}, 8),
                ({"L": 128, "d": 128, "d_k": 64, "d_ff": 512}, 4)]


def _optional(name: str, make: Callable, report: Callable[[str], None]) -> dict:
    try:
        return make()
    except ImportError as missing:
        report(f"    {name}: skipped ({missing})")
        return {}


def _autograd_diagonal(r: Routes, whole: bool) -> tuple[Callable, float]:
    """Autograd's exact diagonal: HVPs along unit vectors, ``CHUNK`` at a time under
    ``vmap``; the callable runs all chunks (``whole``) or one, and the factor scales its
    time to all ``n``."""
    names = r.names
    sizes = [r.params[k].numel() for k in names]
    n = sum(sizes)

    def hvp(direction: torch.Tensor) -> torch.Tensor:
        split = {k: part.reshape(r.params[k].shape)
                 for k, part in zip(names, torch.split(direction, sizes))}
        out = jvp(grad(r._batch_loss), (r.params,), (split,))[1]
        return torch.cat([out[k].reshape(-1) for k in names])

    batched = vmap(hvp)
    chunk = max(1, min(64, 2**24 // n))
    starts = range(0, n, chunk) if whole else range(0, chunk, chunk)

    def run() -> torch.Tensor:
        pieces = []
        for start in starts:
            rows = torch.arange(start, min(start + chunk, n))
            basis = torch.zeros(len(rows), n, dtype=r.X.dtype)
            basis[torch.arange(len(rows)), rows] = 1
            pieces.append(batched(basis)[torch.arange(len(rows)), rows])
        return torch.cat(pieces)
    return run, 1.0 if whole else n / chunk


def _time(routes: dict[str, Callable], repeats: int, report: Callable[[str], None],
          scale: dict[str, float] | None = None) -> dict[str, float]:
    times = {}
    for name, fn in routes.items():
        times[name] = median_time(fn, repeats) * (scale or {}).get(name, 1.0)
        report(f"      {name:<34} {times[name] * 1e3:12.2f} ms"
               + ("  (one chunk, scaled to n)" if (scale or {}).get(name, 1.0) != 1 else ""))
    return times


def _warmed(route: Callable, report: Callable[[str], None]) -> Callable:
    """``route``, called once first (its compilation, reported with its time)."""
    start = time.perf_counter()
    route()
    report(f"      (curvgap torch fused: compiled in {time.perf_counter() - start:.1f} s)")
    return route


def _ratios(times: dict[str, float], ours: list[str]) -> dict[str, float]:
    """Each of ``ours`` against the fastest other route (above 1: curvgap is faster)."""
    others = [t for name, t in times.items() if name not in ours]
    return {name: min(others) / times[name] for name in ours if others}


def _case(r: Routes, config, repeats: int, report: Callable[[str], None]) -> dict:
    """HVP, GGN-vector product and exact diagonal at one size."""
    module = r.modules["torch"]
    numpy_module = r.modules["numpy"]
    args = (r.params, r.X, r.target)
    np_args = tuple({k: v.numpy() for k, v in a.items()} if isinstance(a, dict) else a.numpy()
                    for a in args)
    v_np = r.v.numpy()
    jax_fns = {}
    reason = jax_routes.unsupported(config)
    if reason:
        report(f"    JAX: skipped ({reason})")
    else:
        jax_fns = _optional("JAX", lambda: jax_routes.routes(config, r.params, r.X, r.target,
                                                             r.v), report)
    row: dict = {}
    report("    Hessian-vector product")
    fused = r.modules.get("torch fused")
    ours = ["curvgap torch", "curvgap numpy"] + (["curvgap torch fused"] if fused else [])
    hvp = {"curvgap torch": lambda: module.hvp(*args, r.v),
           "curvgap numpy": lambda: numpy_module.hvp(*np_args, v_np),
           "torch double backward": r.hvp_double_backward(),
           "torch.func jvp of grad": r.hvp_jvp_of_grad()}
    hvp.update(_optional("curvlinops", lambda: {"curvlinops matvec": r.curvlinops_matvec()},
                         report))
    if "jax jit hvp" in jax_fns:
        hvp["jax jit"] = jax_fns["jax jit hvp"]
    if fused:
        hvp["curvgap torch fused"] = _warmed(lambda: fused.hvp(*args, r.v), report)
    row["hvp"] = _time(hvp, repeats, report)
    torch_routes = [k for k in row["hvp"] if k.startswith(("torch", "curvlinops"))]
    row["hvp_vs_fastest_torch"] = {k: min(row["hvp"][t] for t in torch_routes) / row["hvp"][k]
                                   for k in ours}
    if "jax jit" in row["hvp"]:
        row["hvp_vs_jax"] = {k: row["hvp"]["jax jit"] / row["hvp"][k] for k in ours}
    report("    Gauss–Newton-vector product")
    ggn = {"curvgap torch": lambda: module.gnvp(*args, r.v),
           "curvgap numpy": lambda: numpy_module.gnvp(*np_args, v_np)}
    ggn.update(_optional("curvlinops", lambda: {"curvlinops GGN matvec": _ggn_matvec(r)},
                         report))
    if "jax jit ggn" in jax_fns:
        ggn["jax jit"] = jax_fns["jax jit ggn"]
    if fused:
        ggn["curvgap torch fused"] = _warmed(lambda: fused.gnvp(*args, r.v), report)
    row["gnvp"] = _time(ggn, repeats, report)
    for other in ("curvlinops GGN matvec", "jax jit"):
        if other in row["gnvp"]:
            row[f"gnvp_vs_{other.split()[0]}"] = {
                k: row["gnvp"][other] / row["gnvp"][k] for k in ours}
    report("    exact diagonal")
    n = r.v.numel()
    autograd, factor = _autograd_diagonal(r, n <= WHOLE_DIAGONAL)
    diagonal = {"curvgap torch": lambda: module.diagonal(*args),
                "curvgap numpy": lambda: numpy_module.diagonal(*np_args),
                "autograd vmap of n HVPs": autograd}
    row["diagonal"] = _time(diagonal, repeats if n <= WHOLE_DIAGONAL else 1, report,
                            {"autograd vmap of n HVPs": factor})
    row["diagonal_ratios"] = _ratios(row["diagonal"], ["curvgap torch", "curvgap numpy"])
    row["agreement"] = _agreement(r, module, jax_fns, autograd if factor == 1 else None)
    report(f"    agreement (max rel. difference): {row['agreement']}")
    return row


def _ggn_matvec(r: Routes) -> Callable:
    curvlinops = require("curvlinops", "the curvlinops comparison")
    operator = curvlinops.GGNLinearOperator(r.model, torch.nn.MSELoss(),
                                            list(r.model.parameters()), [(r.X, r.target)],
                                            progressbar=False, check_deterministic=False)
    return lambda: operator @ r.v


def _agreement(r: Routes, module, jax_fns: dict, autograd_diagonal: Callable | None
               ) -> dict[str, float]:
    """curvgap's HVP against torch.func's and JAX's, its GGN product against JAX's, its
    diagonal against autograd's (where that was run whole)."""
    def rel(a, b) -> float:
        a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
        return float((a - b).abs().max() / b.abs().max())

    args = (r.params, r.X, r.target)
    mine = module.hvp(*args, r.v)
    out = {"hvp vs torch.func": rel(mine, torch.cat(
        [t.reshape(-1) for t in r.hvp_jvp_of_grad()().values()]))}
    if "torch fused" in r.modules:
        out["fused hvp vs torch.func"] = rel(r.modules["torch fused"].hvp(*args, r.v), torch.cat(
            [t.reshape(-1) for t in r.hvp_jvp_of_grad()().values()]))
    if jax_fns:
        out["hvp vs jax"] = rel(mine, jax_fns["jax jit hvp"]())
        out["gnvp vs jax"] = rel(module.gnvp(*args, r.v), jax_fns["jax jit ggn"]())
    if autograd_diagonal is not None:
        out["diagonal vs autograd"] = rel(module.diagonal(*args), autograd_diagonal())
    return out


def _real_layer(quick: bool, repeats: int, report: Callable[[str], None]) -> dict:
    """``curvgap.curvature`` on a real layer: its HVP, Gauss–Newton product and diagonal
    against reverse-over-reverse autograd on the layer (MATH attention kernel)."""
    (d, heads, d_ff), L, batch = QUICK_REAL_LAYER if quick else REAL_LAYER
    layer = encoder_layer(d, heads, d_ff)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(batch, L, d, generator=gen, dtype=torch.float64)
    T = torch.randn(batch, L, d, generator=gen, dtype=torch.float64)
    r = LayerRoutes(layer, X, T)
    report(f"  real layer: nn.TransformerEncoderLayer(d = {d}, {heads} heads, d_ff = {d_ff}), "
           f"pre-LN, GELU, biases, L = {L}, B = {batch}: n = {r.n}")
    report("    Hessian-vector product")
    hvp = _time({"curvgap torch": r.curvgap_hvp(),
                 "torch double backward": r.hvp_double_backward()}, repeats, report)
    # the attention weights' diagonal needs per-sample tangents of every head's L × L scores
    # in each of their d² entries (~80 GB here): the feed-forward weights' alone
    ffn = ["linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"]
    report(f"    Gauss–Newton-vector product and exact diagonal over {ffn} (curvgap)")
    ours = _time({"curvgap gnvp": lambda: r.curvature.gnvp(X, T, r.v),
                  "curvgap diagonal (FFN)": lambda: r.curvature.diagonal(X, T, wrt=ffn)},
                 1, report)
    agreement = float((r.curvgap_hvp()() - r.hvp_double_backward()()).abs().max()
                      / r.hvp_double_backward()().abs().max())
    report(f"    agreement of the HVPs (max rel. difference): {agreement:.2e}")
    return {"size": {"d": d, "heads": heads, "d_ff": d_ff, "L": L, "B": batch}, "n": r.n,
            "hvp": hvp, "curvgap": ours, "agreement": agreement,
            "hvp_vs_double_backward": hvp["torch double backward"] / hvp["curvgap torch"]}


def _structured(dims: dict, batch: int, report: Callable[[str], None]) -> dict:
    """The Gauss–Newton ``W_V``–``W_V`` block of ``self_attention`` as ``A ⊗ I`` and all of
    its eigenvalues, timed (first call, no warm-up: what a user waits)."""
    module = module_for(load(CONFIGS / "self_attention.toml"))
    params, X, T = random_case(module, dims, batch, seed=0)
    start = time.perf_counter()
    block = kronecker_block(module, params, X, T, "W_V", part="gauss_newton")
    values = block.eigvalsh()
    seconds = time.perf_counter() - start
    dense_bytes = block.shape[0] * block.shape[1] * 8
    report(f"    structured W_V-W_V Gauss–Newton block of self_attention ({block.shape[0]}² "
           f"entries, dense {dense_bytes / 2**30:.3g} GiB): factors and all "
           f"{values.numel()} eigenvalues in {seconds * 1e3:.1f} ms")
    return {"seconds": seconds, "entries": block.shape[0] ** 2, "dense_bytes": dense_bytes,
            "largest_eigenvalue": float(values[-1])}


_MEMORY_CHILD = """
import sys, json, torch
from curvgap.codegen.cache import module_for
from curvgap.codegen.resources import CONFIGS
from curvgap.codegen.verify import random_case
from curvgap.derivations.config import load
dims, batch, backend = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
config = load(CONFIGS / "paper_block.toml")
module = module_for(config, backend)
params, X, T = random_case(module_for(config), dims, batch, seed=0)
if backend == "numpy":
    params, X, T = {k: v.numpy() for k, v in params.items()}, X.numpy(), T.numpy()
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak resident size restarts from now
before = status("VmRSS")
H = module.loss_hessian(params, X, T, wrt="W_V")
print(json.dumps({"peak_extra": status("VmHWM") - before, "output": H.nbytes
                  if backend == "numpy" else H.numel() * H.element_size()}))
"""


def _memory(dims: dict, batch: int, backend: str, report: Callable[[str], None]) -> dict:
    """Peak memory of ``loss_hessian`` over ``W_V`` above the process's resident size before
    the call (in a fresh process, its peak reset before the call), against the block's
    bytes."""
    module_for(load(CONFIGS / "paper_block.toml"), backend)  # generated before, not in it
    run = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, json.dumps(dims), str(batch),
                          backend], capture_output=True, text=True, check=True)
    found = json.loads(run.stdout.strip().splitlines()[-1])
    found["ratio_to_output"] = found["peak_extra"] / found["output"]
    report(f"    dense W_V-W_V block at d = {dims['d']} ({backend}): peak "
           f"{found['peak_extra'] / 2**20:.0f} MiB = {found['ratio_to_output']:.2f} x its "
           f"{found['output'] / 2**20:.0f} MiB")
    return found


def run_scale(config_name: str = "paper_block", quick: bool = False, out: Path | None = None,
              report: Callable[[str], None] = print, fused: bool = False) -> dict:
    """The scale table; returns (and writes to ``out/scale.json``) the results. ``fused``:
    the HVP and Gauss–Newton product of the generated torch module through ``torch.compile``
    too (route ``curvgap torch fused``)."""
    config = load(CONFIGS / f"{config_name}.toml")
    modules = {b: module_for(config, b) for b in ("torch", "numpy")}
    if fused:
        modules["torch fused"] = module_for(config, "torch", fused=True)
    repeats = 1 if quick else 3
    report(f"curvgap bench --scale: {config_name}, float64, "
           f"{torch.get_num_threads()} torch threads, median of at least {repeats} runs")
    report(f"  machine: {machine()}")
    rows = []
    for dims, batch in QUICK_SIZES if quick else SIZES:
        report(f"  size L = {dims['L']}, d = {dims['d']}, d_k = {dims['d_k']}, "
               f"d_ff = {dims['d_ff']}, B = {batch}")
        params, X, target = random_case(modules["torch"], dims, batch, seed=0)
        n = sum(p.numel() for p in params.values())
        v = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        r = Routes(config, modules, params, X, target, v)
        row = {"size": {**dims, "B": batch}, "n": n, **_case(r, config, repeats, report)}
        row["structured"] = _structured(dims, batch, report)
        rows.append(row)
    layer = _real_layer(quick, repeats, report)
    memory = [_memory(dims, batch, backend, report)
              for dims, batch in (QUICK_SIZES if quick else MEMORY_SIZES)
              for backend in ("torch", "numpy")]
    results = {"config": config_name, "quick": quick, "fused": fused, "machine": machine(),
               "rows": rows,
               "real_layer": layer, "memory": memory}
    _print_summary(results, report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "scale.json", json.dumps(results, indent=2))
        report(f"  wrote {out / 'scale.json'}")
    return results


def _print_summary(results: dict, report: Callable[[str], None]) -> None:
    report("\nscale summary (ratio = other route's time / curvgap's; above 1: curvgap faster)")
    report("  (curvgap's faster backend in each column)")
    report(f"  {'L, d, d_k, d_ff, B':<22}{'n':>9}  {'hvp/torch':>10}{'hvp/jax':>9}"
           f"{'gnvp/curvlinops':>16}{'gnvp/jax':>9}{'diag/autograd':>14}{'V-V block':>11}")
    for row in results["rows"]:
        size = row["size"]
        label = f"{size['L']}, {size['d']}, {size['d_k']}, {size['d_ff']}, {size['B']}"
        best = max(row["hvp_vs_fastest_torch"].values())
        jax = max(row.get("hvp_vs_jax", {}).values(), default=float("nan"))
        ggn = max(row.get("gnvp_vs_curvlinops", {}).values(), default=float("nan"))
        ggn_jax = max(row.get("gnvp_vs_jax", {}).values(), default=float("nan"))
        diag = max(row["diagonal_ratios"].values(), default=float("nan"))
        report(f"  {label:<22}{row['n']:>9}  {best:>9.2f}x{jax:>8.2f}x{ggn:>15.2f}x"
               f"{ggn_jax:>8.2f}x{diag:>13.1f}x{row['structured']['seconds'] * 1e3:>8.1f} ms")
    layer = results["real_layer"]
    report(f"  real layer (n = {layer['n']}): hvp / double backward "
           f"{layer['hvp_vs_double_backward']:.2f}x")
    for found in results["memory"]:
        report(f"  dense block peak / output: {found['ratio_to_output']:.2f}")
