"""``curvgap bench``: time generated code against torch.func and curvlinops, in one process.

Each case times every route to one quantity (median of ``repeats`` runs after a warm-up)
and reports each route's ratio to the fastest autograd route;
curvgap's full Hessian and HVP are checked against torch.func in the same run. Results go
to ``bench.json`` with the machine described, and a plot of time against size to
``bench.png``.
"""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .._extras import missing, require
from ..codegen.backends import MODULE_BACKENDS
from ..codegen.generate import render_all
from ..codegen.output import replacing, write_file
from ..codegen.resources import CONFIGS
from ..codegen.verify import random_case
from ..derivations.config import load
from . import depth, real_layer
from .routes import Routes

HEADLINE = {"L": 16, "d": 16, "d_k": 16, "d_ff": 64}
#: The paper's MNIST setting: 49 patches and a class token, batch 128 (full Hessian only).
MNIST = ({"L": 50, "d": 16, "d_k": 16, "d_ff": 64}, 128)


def machine() -> dict:
    """What the numbers were measured on."""
    info = {"platform": platform.platform(), "processor": platform.processor() or "unknown",
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": __import__("os").cpu_count()}
    try:
        from threadpoolctl import threadpool_info
        info["blas"] = [f"{p.get('internal_api')} {p.get('version')} "
                        f"({p.get('num_threads')} threads)" for p in threadpool_info()]
    except ImportError:
        info["blas"] = "threadpoolctl not installed"
    return info


#: Fast routes repeat until their runs add up to about this many seconds (at most
#: :data:`MAX_REPEATS`): a median of many short runs drifts less with the machine's load.
TARGET_SECONDS, MAX_REPEATS = 0.5, 51


def median_time(fn: Callable, repeats: int) -> float:
    """Median of at least ``repeats`` runs after a warm-up (more for a fast route, see
    :data:`TARGET_SECONDS`); a route whose warm-up took over 10 s reports that time
    (warm-up effects are negligible there, and its time is far from any other's)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first > 10:
        return first
    repeats = max(repeats, min(MAX_REPEATS, int(TARGET_SECONDS / max(first, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def assemble(blocks: dict, names: list[str], params: dict) -> torch.Tensor:
    """``torch.func.hessian``'s dict of dicts as one ``(n, n)`` matrix in ``names`` order."""
    sizes = {name: params[name].numel() for name in names}
    return torch.cat([torch.cat([blocks[a][b].reshape(sizes[a], sizes[b]) for b in names], 1)
                      for a in names])


def agreement(routes: Routes) -> dict[str, float]:
    """Relative differences of curvgap's full Hessian and HVP from torch.func's."""
    reference = assemble(routes.hessian_batch()(), routes.names, routes.params)
    scale = reference.abs().max()
    mine = routes.curvgap("torch", "loss_hessian")()
    hv = torch.cat([t.reshape(-1) for t in routes.hvp_jvp_of_grad()().values()])
    return {"loss_hessian": float((mine - reference).abs().max() / scale),
            "hvp": float((routes.curvgap("torch", "hvp")() - hv).abs().max()
                         / hv.abs().max())}


class Runner:
    def __init__(self, config_name: str, repeats: int, rounds: int = 1,
                 report: Callable[[str], None] = print):
        self.config = load(CONFIGS / f"{config_name}.toml")
        self.modules = {b.name: importlib.import_module(f"curvgap.generated.{b.name}."
                                                        f"{config_name}")
                        for b in MODULE_BACKENDS}
        self.repeats, self.rounds, self.report, self.results = repeats, rounds, report, []

    def routes(self, dims: dict, batch: int, dtype: torch.dtype) -> Routes:
        params, X, target = random_case(self.modules["torch"], dims, batch, seed=0,
                                        dtype=dtype)
        n = sum(p.numel() for p in params.values())
        v = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=dtype)
        return Routes(self.config, self.modules, params, X, target, v)

    def case(self, quantity: str, size: dict, candidates: dict[str, Callable | None],
             autograd: list[str]) -> dict:
        """Time every candidate route of one quantity; ratios against the fastest of
        ``autograd``. Routes under a second are timed in ``rounds`` interleaved rounds and
        report the median round: this machine's speed drifts within seconds, and a drift
        would otherwise fall on whichever route ran then."""
        routes = {name: fn for name, fn in candidates.items() if fn is not None}
        rounds: dict[str, list[float]] = {name: [] for name in routes}
        for k in range(self.rounds):
            for name, fn in routes.items():
                if k == 0 or rounds[name][0] < 1:
                    rounds[name].append(median_time(fn, self.repeats))
        times = {name: statistics.median(values) for name, values in rounds.items()}
        for name, seconds in times.items():
            self.report(f"    {quantity:<24} {name:<28} {seconds * 1e3:10.2f} ms")
        baseline = min(times[name] for name in autograd if name in times)
        ratios = {name: baseline / t for name, t in times.items()}
        row = {"quantity": quantity, "size": size, "seconds": times,
               "speedup_vs_fastest_autograd": ratios}
        self.results.append(row)
        return row


def run(config_name: str = "paper_block", quick: bool = False, out: Path | None = None,
        report: Callable[[str], None] = print) -> dict:
    """Run the benchmark suite; return (and write) the results (:class:`ImportError` naming
    the ``bench`` extra, before any work, when ``out`` is given and matplotlib, which draws
    ``bench.png``, is not installed)."""
    if out is not None:
        require("matplotlib", "bench.png", "bench")
    repeats = rounds = 1 if quick else 3
    runner = Runner(config_name, repeats, rounds, report)
    headline, batch = (({"L": 4, "d": 4, "d_k": 4, "d_ff": 8}, 4) if quick
                       else (HEADLINE, 32))
    report(f"curvgap bench: {config_name}, {'quick' if quick else 'full'} run, "
           f"median of at least {repeats} runs after a warm-up, median of {rounds} rounds")
    report(f"  machine: {machine()}")
    absent = missing(["curvlinops"], "the curvlinops comparison")
    if absent:
        report(f"  skipped: {absent}")
    for dtype in (torch.float64,) if quick else (torch.float64, torch.float32):
        _headline(runner, headline, batch, dtype)
    if not quick:
        _mnist(runner)
    _real_layer(runner, quick)
    growth = _depth(runner, quick)
    memory = _peak_memory(runner, headline, batch)
    report(f"  peak memory of numpy loss_hessian: {memory['peak_bytes'] / 2**20:.1f} MiB "
           f"= {memory['ratio_to_output']:.2f} x its output")
    sweep = _sweep(runner, quick)
    start = time.perf_counter()
    render_all([runner.config], report=lambda line: None)
    generate_seconds = time.perf_counter() - start
    report(f"  curvgap generate for {config_name}: {generate_seconds:.1f} s")
    results = {"config": config_name, "quick": quick, "machine": machine(),
               "cases": runner.results, "memory": memory, "sweep": sweep, "depth": growth,
               "generate_seconds": generate_seconds}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / "bench.json", json.dumps(results, indent=2))
        with replacing(out / "bench.png") as temporary:  # never through a link
            _plot(sweep, temporary)
        report(f"  wrote {out / 'bench.json'} and {out / 'bench.png'}")
    _print_table(runner.results, report)
    return results


def _headline(runner: Runner, dims: dict, batch: int, dtype: torch.dtype) -> None:
    """Agreement with torch.func, then every quantity at the headline size in ``dtype``."""
    label = {**dims, "B": batch, "dtype": str(dtype).removeprefix("torch.")}
    runner.report(f"  headline size {label}")
    r = runner.routes(dims, batch, dtype)
    check = agreement(r)
    runner.report(f"    agreement with torch.func (max rel. difference): {check}")
    runner.results.append({"quantity": "agreement", "size": label, "relative": check})
    runner.case("loss_hessian (full)", label, {
        **r.curvgaps("loss_hessian"),
        "torch.func.hessian (batch)": r.hessian_batch(),
        "torch.func.hessian per sample": r.hessian_per_sample(),
        "curvlinops dense": _optional(r.curvlinops_dense),
    }, ["torch.func.hessian (batch)", "torch.func.hessian per sample", "curvlinops dense"])
    for pair in (["W_V"], ["W_1", "W_2"]):
        if set(pair) <= set(r.names):
            runner.case(f"block {'-'.join(pair) if len(pair) > 1 else pair[0] + '-' + pair[0]}",
                        label, {**r.curvgaps("loss_hessian", wrt=pair),
                                "torch.func.hessian (batch)": r.hessian_batch(pair)},
                        ["torch.func.hessian (batch)"])
    runner.case("jacobian (all params)", label, {
        # first, so that it meets the allocator as the generated code does
        "write floor (allocate + fill)": r.write_floor(),
        **r.curvgaps("jacobian"),
        "vmap(jacrev)": r.jacobian("jacrev"),
        "vmap(jacfwd)": r.jacobian("jacfwd"),
    }, ["vmap(jacrev)", "vmap(jacfwd)"])
    runner.case("hvp", label, {
        **r.curvgaps("hvp"),
        "jvp of grad": r.hvp_jvp_of_grad(),
        "double backward": r.hvp_double_backward(),
        "curvlinops matvec": _optional(r.curvlinops_matvec),
    }, ["jvp of grad", "double backward", "curvlinops matvec"])


def _mnist(runner: Runner) -> None:
    """The full loss Hessian at the paper's MNIST setting."""
    dims, batch = MNIST
    label = {**dims, "B": batch, "dtype": "float64"}
    runner.report(f"  the paper's MNIST setting {label}")
    r = runner.routes(dims, batch, torch.float64)
    # torch.func.hessian of the batch loss, or of all samples in one vmap, needs more than
    # this machine's 23 GiB here (killed by the kernel); 8 samples at a time fit
    runner.report("    (torch.func.hessian of the batch loss is left out: it runs out of memory)")
    runner.case("loss_hessian (full), MNIST", label, {
        **r.curvgaps("loss_hessian"),
        "torch.func.hessian per sample (8 at a time)": r.hessian_per_sample(chunk=8),
    }, ["torch.func.hessian per sample (8 at a time)"])


def _real_layer(runner: Runner, quick: bool) -> None:
    """``curvgap.curvature`` on a ``torch.nn.TransformerEncoderLayer`` against reverse over
    reverse on the layer itself."""
    d, heads, d_ff, L, batch = (4, 2, 8, 4, 2) if quick else (16, 2, 32, 16, 8)
    label = {"layer": "TransformerEncoderLayer (pre-LN, GELU, biases)", "L": L, "d": d,
             "heads": heads, "d_ff": d_ff, "B": batch, "dtype": "float64"}
    runner.report(f"  a real layer {label}")
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(batch, L, d, generator=generator, dtype=torch.float64)
            for _ in range(2))
    r = real_layer.LayerRoutes(real_layer.encoder_layer(d, heads, d_ff), X, T)
    check = real_layer.agreement(r)
    runner.report(f"    agreement with reverse over reverse (max rel. difference): {check}")
    runner.results.append({"quantity": "agreement (real layer)", "size": label,
                           "relative": check})
    runner.case("real layer loss_hessian", label, {
        "curvgap.curvature": r.curvgap_hessian(),
        "reverse over reverse (batched rows)": r.hessian_rows(),
    }, ["reverse over reverse (batched rows)"])
    runner.case("real layer hvp", label, {
        "curvgap.curvature": r.curvgap_hvp(), "double backward": r.hvp_double_backward(),
    }, ["double backward"])


#: The largest model whose full Hessian autograd is asked for (its rows in one batched pass).
MAX_AUTOGRAD_ROWS = 2400


def _depth(runner: Runner, quick: bool) -> dict:
    """``curvgap.curvature`` on ``TransformerEncoder`` models of growing depth against
    autograd on the model: per depth the times (and agreement), and the growth exponent of
    each route's time in the depth (a log–log fit)."""
    d, heads, d_ff, L, batch = (4, 2, 8, 4, 2) if quick else (8, 2, 16, 8, 4)
    depths = (1, 2) if quick else (1, 2, 4, 8, 12)
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(batch, L, d, generator=generator, dtype=torch.float64)
            for _ in range(2))
    rows = []
    for n_layers in depths:
        r = depth.DepthRoutes(depth.encoder(n_layers, d, heads, d_ff), X, T)
        label = {"model": "TransformerEncoder (pre-LN, GELU, biases)", "layers": n_layers,
                 "parameters": r.n, "L": L, "d": d, "heads": heads, "d_ff": d_ff, "B": batch,
                 "dtype": "float64"}
        runner.report(f"  depth {n_layers}: {label}")
        row = {"layers": n_layers, "parameters": r.n}
        for quantity, candidates, autograd in (
                ("gradient", {"curvgap": r.curvgap_gradient(),
                              "backward": r.gradient_backward()}, ["backward"]),
                ("hvp", {"curvgap": r.curvgap_hvp(), "double backward": r.hvp_double_backward()},
                 ["double backward"]),
                ("cross-layer block", {"curvgap": r.curvgap_block(),
                                       "reverse over reverse": r.block_rows()},
                 ["reverse over reverse"]),
                ("loss_hessian", {"curvgap": r.curvgap_hessian(), "reverse over reverse":
                                  r.hessian_rows() if r.n <= MAX_AUTOGRAD_ROWS else None},
                 ["reverse over reverse", "curvgap"])):
            case = runner.case(f"depth {quantity}", label, candidates, autograd)
            row.update({f"{quantity}: {name}": t for name, t in case["seconds"].items()})
        block, hvp = r.curvgap_block()(), r.curvgap_hvp()()
        expected_block, expected_hvp = r.block_rows()(), r.hvp_double_backward()()
        row["agreement"] = {
            "cross-layer block": float((block - expected_block).abs().max()
                                       / expected_block.abs().max()),
            "hvp": float((hvp - expected_hvp).abs().max() / expected_hvp.abs().max())}
        runner.report(f"    agreement with autograd (max rel. difference): {row['agreement']}")
        rows.append(row)
    exponents = {}
    for name in rows[0]:
        if ":" in name and all(name in row for row in rows):
            x = np.log([row["layers"] for row in rows])
            exponents[name] = float(np.polyfit(x, np.log([row[name] for row in rows]), 1)[0])
    runner.report("    growth exponents in depth: " + ", ".join(
        f"{k} {v:.2f}" for k, v in exponents.items()))
    return {"rows": rows, "growth_exponents": exponents}


def _optional(make: Callable) -> Callable | None:
    try:
        return make()
    except ImportError:
        return None


def _peak_memory(runner: Runner, dims: dict, batch: int) -> dict:
    r = runner.routes(dims, batch, torch.float64)
    fn = r.curvgap("numpy", "loss_hessian")
    fn()
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak_bytes": peak, "output_bytes": result.nbytes,
            "ratio_to_output": peak / result.nbytes}


def _sweep(runner: Runner, quick: bool) -> dict:
    """Jacobian and HVP times over d (L = 16) and over L (d = 16), with fitted exponents."""
    values = [4, 8] if quick else [8, 16, 32, 64]
    sweep = {}
    for axis in ("d", "L"):
        rows = []
        for value in values:
            dims = {**HEADLINE, axis: value, "d_k": value if axis == "d" else 16}
            if quick:
                dims = {"L": 4, "d": 4, "d_k": 4, "d_ff": 8, axis: value}
            r = runner.routes(dims, 4 if quick else 8, torch.float64)
            rows.append({axis: value, **{name: median_time(fn, runner.repeats) for name, fn in {
                "curvgap jacobian": r.curvgap("torch", "jacobian"),
                "vmap(jacrev)": r.jacobian("jacrev"),
                "curvgap hvp": r.curvgap("torch", "hvp"),
                "jvp of grad": r.hvp_jvp_of_grad()}.items()}})
            runner.report(f"    sweep {axis} = {value}: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in rows[-1].items() if k != axis))
        exponents = {}
        for name in rows[0]:
            if name == axis:
                continue
            x = np.log([row[axis] for row in rows])
            y = np.log([row[name] for row in rows])
            exponents[name] = float(np.polyfit(x, y, 1)[0])
        sweep[axis] = {"rows": rows, "growth_exponents": exponents}
        runner.report(f"    growth exponents in {axis}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in exponents.items()))
    return sweep


def _plot(sweep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweep), figsize=(5 * len(sweep), 4))
    for ax, (axis, data) in zip(np.atleast_1d(axes), sweep.items()):
        rows = data["rows"]
        for name in rows[0]:
            if name != axis:
                ax.loglog([row[axis] for row in rows], [row[name] for row in rows], "o-",
                          label=f"{name} (slope {data['growth_exponents'][name]:.2f})")
        ax.set_xlabel(axis)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"time against {axis}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_table(rows: list[dict], report: Callable[[str], None]) -> None:
    report("\nresults (speed-up = fastest autograd route / this route):")
    for row in rows:
        if "seconds" not in row:
            continue
        size = row["size"]
        report(f"  {row['quantity']} at {size}")
        for name, seconds in row["seconds"].items():
            ratio = row["speedup_vs_fastest_autograd"][name]
            report(f"      {name:<30} {seconds * 1e3:10.2f} ms   {ratio:7.2f}x")
