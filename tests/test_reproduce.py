"""``curvgap reproduce --quick`` end to end: it writes every figure and both reports, every
number is finite, and the results say what they must."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from curvgap import cli

FIGURES = ("hessian_heatmap.png", "block_norms.png", "scaling.png", "convergence.png",
           "whole_model_hessian.png")


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@pytest.mark.slow  # 70 s: the whole quick pipeline of curvgap reproduce
def test_quick_reproduce_writes_finite_results(tmp_path, capsys):
    assert cli.main(["reproduce", "--quick", "--out", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "[1/4] bounds" in shown and "[4/4] convergence done" in shown
    for name in FIGURES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    markdown = (tmp_path / "report.md").read_text()
    assert all(f"]({name})" in markdown for name in FIGURES)
    results = json.loads((tmp_path / "report.json").read_text())
    numbers = list(_numbers(results))
    assert len(numbers) > 500 and all(math.isfinite(n) for n in numbers)

    summaries = {(r["theorem"], r["quantity"]): r for r in results["bounds"]["summaries"]}
    for key in [("Theorem 1 (main text)", "M ≥ ‖H‖"), ("Theorem 1 (appendix)", "M ≥ ‖H‖"),
                ("Theorem 6", "M_tr ≥ ‖H‖")]:
        assert summaries[key]["count"] > 0 and summaries[key]["violation_count"] == 0
    for state in results["structure"]["states"].values():
        assert abs(state["norm_lanczos"] - state["norm_dense"]) <= 1e-8 * state["norm_dense"]
        assert len(state["blocks"]) == 25
        assert all(v > 0 for v in state["smallest_row_variance"].values())   # Assumption 2
    for blocks in results["convergence"]["block_norms"].values():
        assert len(blocks) == 25 and all(b["spectral"] > 0 for b in blocks)
    assert markdown.count("| Sec. 5, Figure") == 5 and "| Sec. 6 |" in markdown
    for config in results["scaling"]["configs"].values():
        for block in config["blocks"]:
            assert abs(block["derived"] - block["measured"]) <= 0.15, block
    convergence = results["convergence"]
    assert convergence["test_accuracy"] > 0.5
    # |ℓ_(k+1) − L_k| ≤ ℓ_max: the bound at w* cannot fail
    assert convergence["violations_optimum"] == 0
    assert -1.2 < convergence["slope_optimum"] < -0.8
    whole = convergence["whole_hessian"]
    assert list(whole["parts"]) == ["embedding", "blocks.0", "head"]
    assert whole["parts"]["head"][1] == convergence["parameters"] == 3322
    for errors in whole["block_diagonal"].values():  # relative errors of an approximation
        assert 0 < errors["frobenius"] <= 1 and 0 < errors["spectral"]


#: Numbers docs/paper.md quotes from the committed full run (docs/reproduce/report.json):
#: (search or sampling, theorem, quantity) and the text that quotes it.
QUOTED = [
    ("search", "Theorem 1 (main text)", "H(K,K) Gauss–Newton", "smallest bound/true {}, `(K,K)`"),
    ("search", "Theorem 1 (appendix)", "H(K,K) Gauss–Newton", "the search: {});"),
    ("search", "App. B.6 Gk_bounds", "‖G_Q‖", "the search: {} and"),
    ("search", "Theorem 1 (appendix)", "M ≥ ‖H‖", "both versions ({}):"),
    ("search", "Theorem 6", "H_tr(Q,K)", "`(K,Q)` ({},"),
    ("search", "Theorem 6", "H_tr(2,1)", "bound/true {}: the printed"),
    ("sampled", "Theorem 6", "H_tr(2,1)", "smallest bound/true {}, `H_tr(2,1)`"),
]


@pytest.mark.parametrize("source, theorem, quantity, text", QUOTED)
def test_the_paper_page_quotes_the_committed_run(source, theorem, quantity, text):
    """docs/paper.md's findings are the numbers of docs/reproduce/report.json, not copies
    that drift from it."""
    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "docs" / "reproduce" / "report.json").read_text())["bounds"]
    if source == "search":
        (row,) = [r for r in results["search"]
                  if (r["theorem"], r["quantity"]) == (theorem, quantity)]
        value = row["ratio"]
    else:
        (row,) = [r for r in results["summaries"]
                  if (r["theorem"], r["quantity"]) == (theorem, quantity)]
        value = row["min_ratio"]
    quoted = f"{value:#.2g}" if value < 1 else f"{value:#.3g}"  # 0.60, 0.0080, 2.62
    page = (root / "docs" / "paper.md").read_text()
    assert text.format(quoted) in page, (text.format(quoted), value)
