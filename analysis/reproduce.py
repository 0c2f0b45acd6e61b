"""``curvgap reproduce [--quick] [--out DIR]``: the paper's analyses in one run.

1. Bounds: Theorem 1 (main text and appendix) and Theorem 6 with their ingredients on
   random instances, bound/true per block (:mod:`.bounds`); the smallest bound/true a
   search finds for each bound (:mod:`.search`); ``M`` and ``M_tr`` at a larger size, the
   true norm by Lanczos.
2. Structure: the block's loss Hessian at initialisation and after training, entry
   heatmaps and block norms (:mod:`.structure`; the paper's Figures 3–5).
3. Scaling: each block's degree in the input scale, derived from the engine's index form
   and fitted numerically, for self-attention and the block with ``eps = 0`` and
   ``eps > 0`` (:mod:`.scaling`).
4. Convergence: a small ViT on the digits and Theorem 7 (:mod:`.vit`; Figure 6), and the
   trained ViT's whole-model loss Hessian with its block-diagonal approximation's error.

Writes ``report.md``, ``report.json`` and the PNG figures to ``out``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import bounds, dominance, scaling, search, structure, vit

FIGURES = {"heatmap": "hessian_heatmap.png", "norms": "block_norms.png",
           "scaling": "scaling.png", "convergence": "convergence.png",
           "whole": "whole_model_hessian.png"}


@dataclass(frozen=True)
class Settings:
    attention_seeds: int
    block_seeds: int
    structure_dims: dict
    structure_samples: int
    structure_steps: int
    large_samples: int
    sigma_step: float
    vit_epochs: int
    hessian_samples: int
    whole_samples: int | None  # None: the whole training set
    #: the worst-case search, (self-attention, block): random restarts, Nelder–Mead
    #: instances per bound, and how many bounds (smallest ratios first; None: all)
    search_restarts: tuple[int, int]
    search_local: tuple[int, int]
    search_bounds: tuple[int | None, int | None]
    #: the wide search of M and M_tr (Lanczos): restarts and Nelder–Mead instances per bound
    search_wide: tuple[int, int]
    search_wide_local: int


QUICK = Settings(attention_seeds=100, block_seeds=12,
                 structure_dims={"L": 8, "d": 8, "d_k": 8, "d_ff": 32}, structure_samples=256,
                 structure_steps=150, large_samples=2, sigma_step=1.0, vit_epochs=4,
                 hessian_samples=4, whole_samples=64, search_restarts=(12, 2),
                 search_local=(10, 0), search_bounds=(3, 0), search_wide=(1, 1),
                 search_wide_local=0)
FULL = Settings(attention_seeds=600, block_seeds=128,
                structure_dims={"L": 16, "d": 16, "d_k": 16, "d_ff": 64},
                structure_samples=512, structure_steps=400, large_samples=4, sigma_step=0.5,
                vit_epochs=40, hessian_samples=128, whole_samples=None,
                search_restarts=(400, 160), search_local=(60, 20), search_bounds=(None, None),
                search_wide=(40, 24), search_wide_local=24)

#: Scaling: the configs, the σ range drawn, and the largest σ of the fit (the small-σ
#: regime; with eps > 0 LayerNorm is linear only while σ² var(input) ≪ eps).
SCALING = {"self_attention": (-5.0, 1.0, 1e-3), "paper_block": (-5.0, 1.0, 1e-3),
           "paper_block_eps": (-10.0, 1.0, 1e-8)}
SCALING_DIMS = {"L": 5, "d": 4, "d_k": 3, "d_ff": 6}


@contextmanager
def _single_thread() -> Iterator[None]:
    """One intra-op thread: the tensors here are small, and on a shared 2-core machine
    spinning threads slow them down several-fold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(quick: bool, out: Path, report: Callable[[str], None] | None = None) -> dict:
    """Every analysis, its figures and ``report.md`` / ``report.json`` in ``out``; returns
    the JSON content."""
    say = report or (lambda line: print(line, flush=True))
    settings = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"quick": quick, "machine": _machine(), "seconds": {}}
    start = time.perf_counter()
    steps = (("bounds", _bounds), ("structure", _structure), ("scaling", _scaling),
             ("convergence", _convergence))
    with _single_thread():
        for n, (name, step) in enumerate(steps, 1):
            began = time.perf_counter()
            say(f"[{n}/{len(steps)}] {name} ...")
            results[name] = step(settings, out, say, results)
            results["seconds"][name] = time.perf_counter() - began
            say(f"[{n}/{len(steps)}] {name} done in {results['seconds'][name]:.1f} s")
    results["seconds"]["total"] = time.perf_counter() - start
    if not finite_numbers(results):
        raise ValueError("results: expected finite numbers only, got a NaN or infinity")
    (out / "report.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (out / "report.md").write_text(markdown(results))
    say(f"wrote {out / 'report.md'}, {out / 'report.json'} and "
        f"{', '.join(FIGURES.values())} in {results['seconds']['total']:.1f} s")
    return results


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "processor": platform.processor() or platform.machine()}


# -- 1. bounds -------------------------------------------------------------------------------
def _bounds(settings: Settings, out: Path, say, results: dict) -> dict:
    summaries = bounds.survey(range(settings.attention_seeds), range(settings.block_seeds),
                              say)
    rows = [{"theorem": s.theorem, "quantity": s.quantity, "count": len(s.ratios),
             "median_ratio": s.median, "min_ratio": s.minimum,
             "violations": sorted(s.violations, key=lambda v: v["ratio"])[:5],
             "violation_count": len(s.violations)}
            for s in summaries]
    sampled = {(r["theorem"], r["quantity"]): r["min_ratio"] for r in rows}
    worst: dict[tuple[str, str], search.Worst] = {}
    for k, block in enumerate((False, True)):
        found = search.search(block, settings.search_restarts[k], settings.search_local[k],
                              settings.search_bounds[k], say)
        for key, candidate in found.worst.items():  # App. B.6's G_k: on both kinds
            if key not in worst or candidate.ratio < worst[key].ratio:
                worst[key] = candidate
    searched = sorted(({**w.as_dict(), "sampled_min_ratio": sampled.get(key)}
                       for key, w in worst.items()), key=lambda r: r["ratio"])
    wide = []
    for k, block in enumerate((False, True)):
        found = search.search(block, settings.search_wide[k], settings.search_wide_local,
                              progress=say, wide=True)
        wide += [worst.as_dict() for worst in found.worst.values()]
    wide.sort(key=lambda r: r["ratio"])
    return {"attention_seeds": settings.attention_seeds, "block_seeds": settings.block_seeds,
            "summaries": rows, "search": searched, "search_wide": wide}


def _large_instances(trained: structure.Trained, samples: int) -> list[dict]:
    """``M`` (Theorem 1, the block's attention weights) and ``M_tr`` (Theorem 6) against
    ``‖H_i‖₂`` for a few samples of the trained regression block; Lanczos above
    :data:`~.spectra.DENSE_LIMIT` parameters."""
    rows = []
    attention = {k: trained.final[k] for k in ("W_Q", "W_K", "W_V")}
    for i in range(samples):
        X, target = trained.X[i], trained.target[i]
        checks = [c for c in bounds.theorem1(attention, X, target) if c.quantity.startswith("M")]
        checks += bounds.theorem6(trained.final, X, target, ("printed",), per_block=False)
        rows += [{"sample": i, "theorem": c.theorem, "quantity": c.quantity, "bound": c.bound,
                  "true": c.true, "ratio": c.ratio} for c in checks]
    return rows


# -- 2. structure ----------------------------------------------------------------------------
def _structure(settings: Settings, out: Path, say, results: dict) -> dict:
    dims = settings.structure_dims
    trained = structure.train_regression(dims, settings.structure_samples,
                                         settings.structure_steps, progress=say)
    states = {"initialisation": structure.structure(trained.initial, trained.X, trained.target),
              "trained": structure.structure(trained.final, trained.X, trained.target)}
    structure.plot_heatmaps(states, out / FIGURES["heatmap"])
    structure.plot_block_norms(states, out / FIGURES["norms"])
    say(f"  Hessian n = {states['trained'].H.shape[0]}: ‖H‖₂ dense "
        f"{states['trained'].dense_norm:.6g}, Lanczos {states['trained'].lanczos_norm:.6g}")
    large = _large_instances(trained, settings.large_samples)
    say(f"  M and M_tr on {settings.large_samples} samples of the trained block")
    return {"dims": dims, "batch": trained.X.shape[0], "steps": settings.structure_steps,
            "train_loss_first": trained.losses[0], "train_loss_last": trained.losses[-1],
            "states": {name: {"loss": s.loss, "norm_dense": s.dense_norm,
                              "norm_lanczos": s.lanczos_norm,
                              "smallest_row_variance": s.variances,
                              "blocks": [{"rows": a, "cols": b, **v}
                                         for (a, b), v in s.norms.items()]}
                       for name, s in states.items()},
            "large_instances": large}


# -- 3. scaling ------------------------------------------------------------------------------
def _scaling(settings: Settings, out: Path, say, results: dict) -> dict:
    sweeps, fit_below, degrees, configs = {}, {}, {}, {}
    for name, (low, high, fit) in SCALING.items():
        degrees[name] = scaling.block_degrees(name)
        count = int(round((high - low) / settings.sigma_step)) + 1
        sweeps[name] = scaling.sweep(name, SCALING_DIMS, np.logspace(low, high, count))
        fit_below[name] = fit
        small = sweeps[name].sigmas <= fit
        blocks, zero = [], []
        for block, degree in degrees[name].items():
            measured = scaling.fitted_exponent(sweeps[name].sigmas[small],
                                               sweeps[name].norms[block][small])
            if degree is None and measured is None:
                zero.append(scaling.short(block))
                continue
            blocks.append({"block": scaling.short(block), "rows": block[0], "cols": block[1],
                           "part": block[2], "derived": float(degree),
                           "derived_exact": str(degree), "measured": measured})
        configs[name] = {"fit_sigma_max": fit, "fit_points": int(small.sum()),
                         "blocks": blocks, "zero_blocks": zero}
        say(f"  {name}: {len(blocks)} blocks, largest |derived − fit| "
            f"{max(abs(b['derived'] - b['measured']) for b in blocks):.3f}")
    scaling.plot_scaling(sweeps, fit_below, degrees, out / FIGURES["scaling"])
    return {"dims": SCALING_DIMS, "configs": configs}


# -- 4. convergence --------------------------------------------------------------------------
def _convergence(settings: Settings, out: Path, say, results: dict) -> dict:
    data = vit.digits()
    params, losses = vit.train(data, settings.vit_epochs, progress=say)
    result = vit.convergence(params, data, settings.hessian_samples, progress=say)
    vit.plot_convergence(result, out / FIGURES["convergence"])
    dominant = {"initialisation": vit.block_hessian_norms(vit.init_params(), data),
                "trained": vit.block_hessian_norms(params, data)}
    samples = min(settings.whole_samples or len(data.train_y), len(data.train_y))
    whole = vit.whole_hessian(params, data, samples)
    vit.plot_whole_hessian(whole, out / FIGURES["whole"])
    say(f"    whole-model Hessian over {samples} images (n = {whole.H.shape[0]}): ‖H‖₂ = "
        f"{whole.norm:.4g}, block-diagonal by layer off by "
        f"{whole.block_diagonal['layers']['frobenius']:.3f} (Frobenius)")
    return {"dims": vit.DIMS, "epochs": settings.vit_epochs, "train_samples": len(data.train_y),
            "parameters": whole.H.shape[0],
            "test_accuracy": vit.accuracy(params, data.test_x, data.test_y),
            "train_loss_last": losses[-1], "loss_bound": result.loss_bound, "M": result.M,
            "hessian_norms": result.hessian_norms, "radius": result.radius,
            "slope_optimum": result.slope_optimum, "slope_perturbed": result.slope_perturbed,
            "violations_optimum": result.violations_optimum,
            "violations_perturbed": result.violations_perturbed,
            "gap_optimum_last": float(result.gap_optimum[-1]),
            "gap_perturbed_last": float(result.gap_perturbed[-1]),
            "block_norms": {state: _listed(norms) for state, norms in dominant.items()},
            "whole_hessian": {"samples": samples, "norm": whole.norm,
                              "parts": {k: [v.start, v.stop] for k, v in whole.parts.items()},
                              "block_diagonal": whole.block_diagonal,
                              "part_norms": _part_norms(whole)}}


def _listed(norms: dominance.Norms) -> list[dict]:
    return [{"rows": a, "cols": b, "spectral": value} for (a, b), value in norms.items()]


def _keyed(blocks: list[dict], prefix: str = "") -> dominance.Norms:
    """``{(a, b): ‖H_ab‖₂}`` with short names from a JSON list of blocks."""
    return {(b["rows"].removeprefix(prefix), b["cols"].removeprefix(prefix)): b["spectral"]
            for b in blocks}


def _part_norms(whole: vit.WholeHessian) -> dict[str, float]:
    """The spectral norm of each block of parts, ``"rows × columns"``."""
    names = list(whole.parts)
    return {f"{a} × {b}": float(torch.linalg.matrix_norm(
        whole.H[whole.parts[a], whole.parts[b]], ord=2))
        for n, a in enumerate(names) for b in names[n:]}


# -- report ----------------------------------------------------------------------------------
def _g(value: float) -> str:
    return f"{value:.3g}"


def markdown(results: dict) -> str:
    """``report.md`` from the JSON results."""
    lines = ["# curvgap reproduce: the paper's analyses", "",
             f"Mode: {'quick' if results['quick'] else 'full'}; total "
             f"{results['seconds']['total']:.0f} s ("
             + ", ".join(f"{k} {v:.0f} s" for k, v in results["seconds"].items()
                         if k != "total")
             + f"); torch {results['machine']['torch']}, float64, 1 thread.", ""]
    lines += _bounds_section(results["bounds"], results["structure"]["large_instances"])
    lines += _structure_section(results["structure"])
    lines += _dominance_section(results["structure"], results["convergence"])
    lines += _scaling_section(results["scaling"])
    lines += _convergence_section(results["convergence"])
    return "\n".join(lines) + "\n"


READINGS = """Readings of the printed formulas (see `docs/ERRATA.md`):
- Per sample: `X` is one `L×d` input, `ℓ = ‖Z − T‖_F²/(L·d)`, `H_i = ∇²_w ℓ`; `‖·‖` spectral.
- Theorem 1: the per-block bounds are the summands of the four arguments of the max (App. B.1,
  step 6): Gauss–Newton (`H_o`) and functional (`H_f`); `H(K,K)`, `H(V,K)` are `H(Q,Q)`,
  `H(V,Q)` with `W_Q ↔ W_K`. Main text uses `√min(L,d)`, the appendix `√rank(F − T)`.
  `M ≥ ‖H‖` is the printed `M`, `3 max` of its four arguments; `M ≥ ‖H‖, six blocks (ours)`
  is our repair, `3 max` over all six blocks, as the proof's step 6 assembles. The
  true `‖H(V,V)‖` comes from the block's exact Kronecker form `A ⊗ I_d` (`A` is `d × d`).
- Theorem 6: every factor by its printed bound (App. B.6; App. C's proposition for `‖Y‖, ‖S‖`
  and its LayerNorm lemma for `J_Y, H_Y, J_Z, H_Z` with the measured `‖X + F(X)‖` and
  `σ_min` of both LayerNorm inputs, `‖B_2‖ = ‖ReLU(Y W_1)‖` measured as printed);
  `‖R^tr‖ = ‖Z − T‖_F`, as printed without the `2/(L·d)` of `∂ℓ/∂Z`; `ξ_12, ξ_21` as printed;
  blocks `(k,1), (k,2)` (no `ξ` printed) are covered by `(1,k), (2,k)` of the symmetric loss
  Hessian. `σ_min` of the LayerNorm lemma: as printed, `min_i ‖M_i‖₂`, and read as the
  smallest row standard deviation `min_i ‖M_i‖₂/√d` (the `P = diag⁻¹(σ)` of the proof).
- Ingredients are checked against their exact values: the steps of Theorem 1's proof
  (`∂A/∂T` from the engine's softmax Jacobian, `Z_1`, `A`, `AX`, `∂²A/∂T²` by
  `torch.func.hessian` of the row softmax), `G_k = ∂F/∂W_k`, `Φ_kℓ = ∂²F/∂W_k∂W_ℓ`
  (generated `self_attention`), the FFN factors `B_1`, `J_SY`, `ξ_12`, `ξ_21` (generated
  `ffn`, with the true `‖Y‖`), `J_LN`, `H_LN` (generated `layernorm`), `Y`, `S`."""


def _bounds_section(data: dict, large: list[dict]) -> list[str]:
    rows = data["summaries"]
    lines = ["## 1. Spectral-norm bounds (Theorems 1 and 6)", "",
             f"{data['attention_seeds']} random self-attention instances and "
             f"{data['block_seeds']} random block instances (`bounds.random_instance`: "
             "`L ∈ 2..24`, `d ∈ 2..5` (block `3..5`), `d_k ∈ 1..4`, `d_ff ∈ 2..6`, input scale "
             "log-uniform on `[0.3, 3]`, weight scale on `[0.2, 2]`), per sample. "
             "`bound/true` below 1 is a violated bound.", "", READINGS, "",
             "### Violated bounds", ""]
    violated = [r for r in rows if r["violation_count"]]
    violated.sort(key=lambda r: _form(r) != "printed")
    if violated:
        lines += ["| bound | quantity | form | violated | min bound/true | worst instance |",
                  "| --- | --- | --- | ---: | ---: | --- |"]
        for r in violated:
            worst = min(r["violations"], key=lambda v: v["ratio"])
            lines.append(f"| {r['theorem']} | {r['quantity']} | {_form(r)} | "
                         f"{r['violation_count']}/{r['count']} | {_g(r['min_ratio'])} | "
                         f"seed {worst['seed']}, L="
                         f"{worst['L']}, d={worst['d']}, d_k={worst['d_k']}"
                         + (f", d_ff={worst['d_ff']}" if worst["block"] else "")
                         + f": bound {_g(worst['bound'])}, true {_g(worst['true'])} |")
    else:
        lines.append("None.")
    lines += ["", "### Tightness: median and smallest bound/true per block", "",
              "| bound | quantity | instances | median | min |",
              "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['theorem']} | {r['quantity']} | {r['count']} | {_g(r['median_ratio'])} | "
              f"{_g(r['min_ratio'])} |" for r in rows]
    lines += _search_section(data["search"], data["search_wide"])
    lines += ["", "### Larger size (trained regression block, true norm dense or Lanczos)", "",
              "| sample | bound | quantity | bound value | true | bound/true |",
              "| ---: | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['sample']} | {r['theorem']} | {r['quantity']} | {_g(r['bound'])} | "
              f"{_g(r['true'])} | {_g(r['ratio'])} |" for r in large]
    return lines + [""]


def _form(row: dict) -> str:
    """``"printed"`` for the paper's bound as printed, ``"ours"`` for one of our repairs."""
    return "printed" if bounds.is_printed(row["theorem"], row["quantity"]) else "ours"


def _verdict(row: dict) -> str:
    return "**violated**" if row["violated"] else "holds"


def _search_section(rows: list[dict], wide: list[dict]) -> list[str]:
    """The per-bound tables of the worst-case search, against the sampling's minimum: the
    paper's bounds as printed, then our repairs, each with its verdict; then ``M`` and
    ``M_tr`` searched at larger sizes."""
    lines = ["", "### Worst cases by search", "",
             "The smallest bound/true found per bound by `analysis.search` (random restarts "
             "over sizes and per-weight, input, row-offset and target scales, then Nelder–Mead "
             "on the ratio), next to the smallest over the random instances above. An "
             "instance is `search.Spec(block, seed, dims, scales)`: `W = e^{s_W} G_W`, "
             "`X = e^{s_x}(G_X + e^{s_c} m 1ᵀ)`, `T = e^{s_t} G_T`. Violated: below "
             "`1 − 1e-9` (closer to 1 is an equality up to rounding). The paper's statements "
             "as printed come first, each with its own verdict; our repairs (`σ_min` read as "
             "the row standard deviation, `M` over all six blocks) follow apart."]
    for title, printed in (("As printed", True), ("Our repairs", False)):
        chosen = [r for r in rows if (_form(r) == "printed") == printed]
        violated = sum(r["violated"] for r in chosen)
        lines += ["", f"**{title}**: {violated} of {len(chosen)} bounds violated.", "",
                  "| bound | quantity | sampled min | searched min | verdict | instance | "
                  "instances |",
                  "| --- | --- | ---: | ---: | --- | --- | ---: |"]
        for r in chosen:
            where = ", ".join(f"{k}={v}" for k, v in r["instance"].items() if k != "block")
            sampled = "—" if r["sampled_min_ratio"] is None else _g(r["sampled_min_ratio"])
            lines.append(f"| {r['theorem']} | {r['quantity']} | {sampled} | {_g(r['ratio'])} | "
                         f"{_verdict(r)} | {where} | {r['evaluations']} |")
    lines += ["", "**At larger sizes** (`L ∈ 16..40`, `d ∈ 16..32`, `d_k ∈ 4..16`, "
              "`d_ff ∈ 16..48`, up to a few thousand parameters; `‖H_i‖₂` by Lanczos on the "
              "generated `hvp` above 1,500 parameters, no dense Hessian): `M` and `M_tr` "
              "only.", "",
              "| bound | quantity | form | searched min | verdict | instance | instances |",
              "| --- | --- | --- | ---: | --- | --- | ---: |"]
    for r in wide:
        where = ", ".join(f"{k}={v}" for k, v in r["instance"].items()
                          if k not in ("block", "wide"))
        lines.append(f"| {r['theorem']} | {r['quantity']} | {_form(r)} | {_g(r['ratio'])} | "
                     f"{_verdict(r)} | {where} | {r['evaluations']} |")
    return lines


def _structure_section(data: dict) -> list[str]:
    dims = data["dims"]
    lines = ["## 2. Structure of the block's loss Hessian (Figures 3–5)", "",
             f"`paper_block` (`L={dims['L']}, d={dims['d']}, d_k={dims['d_k']}, "
             f"d_ff={dims['d_ff']}`), trained by Adam for {data['steps']} steps on a teacher "
             f"regression (MSE {data['train_loss_first']:.3g} → {data['train_loss_last']:.3g}); "
             f"exact Hessian of one batch of {data['batch']} (generated `loss_hessian`).", "",
             f"![log10 |H|]({FIGURES['heatmap']})", "", f"![block norms]({FIGURES['norms']})",
             "", "| state | loss | ‖H‖₂ (eigvalsh) | ‖H‖₂ (Lanczos on hvp) | largest block "
             "(spectral) | largest diagonal block |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for name, state in data["states"].items():
        top = max(state["blocks"], key=lambda b: b["spectral"])
        diagonal = max((b for b in state["blocks"] if b["rows"] == b["cols"]),
                       key=lambda b: b["spectral"])
        lines.append(f"| {name} | {state['loss']:.4g} | {state['norm_dense']:.6g} | "
                     f"{state['norm_lanczos']:.6g} | {top['rows']}–{top['cols']} "
                     f"{_g(top['spectral'])} | {diagonal['rows']}–{diagonal['cols']} "
                     f"{_g(diagonal['spectral'])} |")
    lines += ["", "Spectral norms of the diagonal blocks:", "",
              "| state | " + " | ".join(b["rows"] for b in data["states"]["trained"]["blocks"]
                                        if b["rows"] == b["cols"]) + " |",
              "| --- |" + " ---: |" * 5]
    for name, state in data["states"].items():
        lines.append(f"| {name} | " + " | ".join(_g(b["spectral"]) for b in state["blocks"]
                                                 if b["rows"] == b["cols"]) + " |")
    lines += ["", "Assumption 2 (Sec. 3: every row of each LayerNorm input has variance > 0; "
              "`paper_block` has `eps = 0`), the smallest row variance over the batch:", "",
              "| state | X + F(X) | Y + FFN(Y) |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {_g(state['smallest_row_variance']['X + F(X)'])} | "
              f"{_g(state['smallest_row_variance']['Y + FFN(Y)'])} |"
              for name, state in data["states"].items()]
    return lines + [""]


def _dominance_section(structure_data: dict, convergence: dict) -> list[str]:
    """The paper's statements on which blocks dominate, each tested on the regression
    block's and the digits ViT's block norms before and after training."""
    measured = {
        "regression block": [_keyed(structure_data["states"][state]["blocks"], "W_")
                             for state in ("initialisation", "trained")],
        "digits ViT": [_keyed(convergence["block_norms"][state])
                       for state in ("initialisation", "trained")]}
    found = {name: dominance.verdicts(*norms) for name, norms in measured.items()}
    lines = ["### The paper's statements on which blocks dominate", "",
             "Each statement tested on the spectral norms `‖H_ab‖₂` of the loss-Hessian blocks "
             "`a, b ∈ {Q, K, V, 1, 2}` before and after training: the regression block above "
             "(MSE, one batch of "
             f"{structure_data['batch']}) and the digits ViT's block (section 4; "
             "cross-entropy, the first 128 training images of scikit-learn's 8×8 digits in "
             "4 patches of 4×4: one block, d = 16, d_ff = 64, a small stand-in for the "
             "paper's MNIST ViT, whose images give 49 patches). Attention blocks: "
             "`a, b ∈ {Q, K, V}` "
             "(`analysis/dominance.py`).", "",
             "| statement | where | " + " | ".join(found) + " |",
             "| --- | --- |" + " --- |" * len(found)]
    for row in zip(*found.values()):
        cells = " | ".join(f"{'agrees' if v.agrees else '**disagrees**'}: {v.measured}"
                           for v in row)
        lines.append(f"| {row[0].statement} | {row[0].where} | {cells} |")
    return lines + [""]


def _scaling_section(data: dict) -> list[str]:
    configs = data["configs"]
    lines = ["## 3. Scaling exponents in the input scale (X → σX)", "",
             "Derived: the valuation in σ of each loss-Hessian block, read off the engine's "
             "index-form definitions (`analysis/scaling.py`). Measured: the slope of "
             "log ‖block‖_F against log σ at small σ (float64, sizes "
             f"{data['dims']}, weights and target fixed). `paper_block` has LayerNorm with "
             "`eps = 0` (scale invariant); `paper_block_eps` has `eps = 1e-5`, where as σ → 0 "
             "LayerNorm becomes the linear map `C/√eps`.", "", f"![scaling]({FIGURES['scaling']})",
             ""]
    names = list(configs)
    header = " | ".join(f"{n} derived | fit" for n in names)
    lines += [f"| block | {header} |", "| --- |" + " ---: | ---: |" * len(names)]
    widest = max(names, key=lambda n: len(configs[n]["blocks"]) + len(configs[n]["zero_blocks"]))
    for key in [b["block"] for b in configs[widest]["blocks"]] + configs[widest]["zero_blocks"]:
        cells = []
        for n in names:
            found = [b for b in configs[n]["blocks"] if b["block"] == key]
            if found:
                fit = round(found[0]["measured"], 3) + 0.0       # no "-0.000"
                cells.append(f"{found[0]['derived_exact']} | {fit:.3f}")
            elif key in configs[n]["zero_blocks"]:
                cells.append("0 (zero block) | –")
            else:
                cells.append("– | –")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "Fit ranges: " + ", ".join(f"{n}: σ ≤ {configs[n]['fit_sigma_max']:g} "
                                             f"({configs[n]['fit_points']} points)"
                                             for n in names) + "."]
    return lines + [""]


def _convergence_section(data: dict) -> list[str]:
    dims = data["dims"]
    return ["## 4. Loss-landscape convergence (Theorem 7, Figure 6)", "",
            f"ViT on scikit-learn's digits (`configs/models/digits_vit.toml`): 4×4 patches "
            f"(L = {dims['L']}), d = {dims['d']}, one post-LN block (LayerNorm eps = 1e-5, "
            f"d_k = {dims['d_k']}, d_ff = {dims['d_ff']}), "
            f"mean pool, linear head, cross-entropy; Adam for {data['epochs']} epochs on "
            f"{data['train_samples']} images, test accuracy {data['test_accuracy']:.3f}. "
            f"w = every parameter of the model (n = {data['parameters']}: embedding, block "
            "and head), the Hessians the whole model's (`curvgap.models.Model`).", "",
            f"![convergence]({FIGURES['convergence']})", "",
            "| quantity | value |", "| --- | ---: |",
            f"| ℓ_max = max_i ℓ_i(w*) | {data['loss_bound']:.4g} |",
            f"| M = max of {len(data['hessian_norms'])} per-sample ‖∇²ℓ_i(w*)‖₂ (Lanczos) | "
            f"{data['M']:.4g} |",
            f"| median per-sample ‖∇²ℓ_i(w*)‖₂ | {float(np.median(data['hessian_norms'])):.4g} |",
            f"| ‖w − w*‖ of the perturbed point (M r² = 2ℓ_max) | {data['radius']:.4g} |",
            f"| log–log slope of \\|L_(k+1) − L_k\\| at w*, k ≥ 10 | {data['slope_optimum']:.3f} |",
            f"| same at the perturbed w | {data['slope_perturbed']:.3f} |",
            f"| k where the gap exceeds the bound, at w* / perturbed | "
            f"{data['violations_optimum']} / {data['violations_perturbed']} |", "",
            "`L_(k+1) − L_k = (ℓ_(k+1) − L_k)/(k+1)` exactly, so the slope −1 is the "
            "arithmetic of a running mean; at w* the bound `2ℓ_max/(k+1)` holds because "
            "`|ℓ_(k+1) − L_k| ≤ ℓ_max`. Away from w* the theorem drops the first-order term "
            "`(∇ℓ_(k+1) − ∇L_k)·(w − w*)/(k+1)` (Assumption 1), which per-sample gradients "
            "do not satisfy; M is the largest norm among the sampled per-sample Hessians, not "
            "a supremum.", ""] + _whole_hessian_section(data["whole_hessian"])


def _whole_hessian_section(data: dict) -> list[str]:
    errors = data["block_diagonal"]
    lines = ["### The trained ViT's whole-model loss Hessian", "",
             f"The exact loss Hessian over every parameter, averaged over {data['samples']} "
             f"training images (`Model.loss_hessian`, cross-layer blocks included): "
             f"‖H‖₂ = {data['norm']:.4g}. White lines bound the layers (embedding, block, "
             "head), grey ones the parameters.", "", f"![whole-model Hessian]({FIGURES['whole']})",
             "", "| block-diagonal approximation | ‖H − D‖_F / ‖H‖_F | ‖H − D‖₂ / ‖H‖₂ |",
             "| --- | ---: | ---: |",
             f"| by layer | {errors['layers']['frobenius']:.3f} | "
             f"{errors['layers']['spectral']:.3f} |",
             f"| by parameter | {errors['parameters']['frobenius']:.3f} | "
             f"{errors['parameters']['spectral']:.3f} |", "",
             "Spectral norms of the layer blocks:", "", "| block (rows × columns) | ‖block‖₂ |",
             "| --- | ---: |"]
    lines += [f"| {name} | {value:.4g} |" for name, value in data["part_norms"].items()]
    return lines + [""]


def finite_numbers(value) -> bool:
    """Whether every number in a JSON-like structure is finite."""
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True
