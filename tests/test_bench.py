"""``curvgap bench --quick`` and its ``--scale`` and ``--models`` modes as smoke tests: they run,
write their files, every number is finite and the routes agree (no timing assertion: speed
is measured, not tested)."""

from __future__ import annotations

import json
import math

import pytest

from curvgap import cli


@pytest.mark.slow  # a minute; CI runs it
def test_quick_bench_writes_finite_results(tmp_path):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    timed = [row for row in results["cases"] if "seconds" in row]
    assert {row["quantity"] for row in timed} >= {"loss_hessian (full)", "hvp",
                                                  "jacobian (all params)",
                                                  "real layer loss_hessian", "real layer hvp",
                                                  "depth hvp", "depth cross-layer block"}
    for row in timed:
        assert all(math.isfinite(t) and t > 0 for t in row["seconds"].values())
    for row in results["cases"]:
        if row["quantity"] in ("agreement", "agreement (real layer)"):
            assert max(row["relative"].values()) < 1e-10
    assert [row["layers"] for row in results["depth"]["rows"]] == [1, 2]
    for row in results["depth"]["rows"]:
        assert max(row["agreement"].values()) < 1e-10
    assert all(math.isfinite(e) for e in results["depth"]["growth_exponents"].values())
    assert results["machine"]["torch"].startswith("2.")


@pytest.mark.slow
def test_quick_scale_bench_writes_finite_results_that_agree(tmp_path):
    assert cli.main(["bench", "--scale", "--quick", "--fused", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scale.json").read_text())
    assert len(results["rows"]) == 2 and results["fused"] is True
    for row in results["rows"]:
        for quantity in ("hvp", "gnvp", "diagonal"):
            assert {"curvgap torch", "curvgap numpy"} <= set(row[quantity])
            assert all(math.isfinite(t) and t > 0 for t in row[quantity].values())
        for quantity in ("hvp", "gnvp"):
            assert "curvgap torch fused" in row[quantity]
        assert "fused hvp vs torch.func" in row["agreement"]
        assert {"torch double backward", "torch.func jvp of grad",
                "autograd vmap of n HVPs"} <= set(row["hvp"]) | set(row["diagonal"])
        # the quick sizes time the autograd diagonal whole, so it is compared too
        assert max(row["agreement"].values()) < 1e-10
        assert "diagonal vs autograd" in row["agreement"]
        assert row["structured"]["seconds"] > 0
    assert all(m["ratio_to_output"] > 0 for m in results["memory"])


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
def test_quick_models_bench_agrees_with_autograd(tmp_path, fused):
    pytest.importorskip("transformers")
    pytest.importorskip("scipy")
    assert cli.main(["bench", "--models", "--quick", "--out", str(tmp_path)]
                    + (["--fused"] if fused else [])) == 0
    results = json.loads((tmp_path / "models.json").read_text())
    assert results["fused"] is fused
    rows = {row["model"]: row for row in results["rows"]}
    assert set(rows) == {"GPT-2 (tiny)", "GPT-2 LM (tiny)", "Llama layer (tiny)", "ViT (tiny)"}
    for row in rows.values():
        assert all(math.isfinite(t) and t > 0 for t in row["seconds"].values())
        assert all(math.isfinite(r) and r > 0 for r in row["ratio"].values())
    # float64 throughout: exact; Llama's norms compute in float32 inside; the ViT in float32
    assert max(rows["GPT-2 (tiny)"]["relative_error"].values()) < 1e-10
    assert max(rows["GPT-2 LM (tiny)"]["relative_error"].values()) < 1e-10
    assert max(rows["Llama layer (tiny)"]["relative_error"].values()) < 1e-5
    assert max(rows["ViT (tiny)"]["relative_error"].values()) < 1e-4
    try:  # against curvlinops' GGN matvec too, a single product and the operator's
        import curvlinops  # noqa: F401
    except ImportError:
        pass
    else:
        for name, row in rows.items():  # (its loss over (B, L, classes) logits: not the LM's)
            assert ({"gnvp_curvlinops", "gn_operator_curvlinops"} <= set(row["relative_error"])
                    ) is (name != "GPT-2 LM (tiny)")
    top = results["eigenvalue"]
    assert math.isclose(top["curvgap"]["eigenvalue"], top["double_backward"]["eigenvalue"],
                        rel_tol=1e-8)
    exact = results["diagonal"]  # the exact diagonal against double backward on unit vectors
    if fused:  # (not compiled: the unfused run has it)
        assert exact is None
        return
    assert exact["relative_error"] < 1e-10
    assert exact["seconds"] > 0 and exact["estimated_seconds"] > 0
    assert exact["hutchinson_products"] >= 64 and exact["hutchinson_relative_error"] > 0


@pytest.mark.parametrize("name, fused", [("models", False), ("models_fused", True),
                                         ("models_fused_all_threads", True)])
def test_the_committed_whole_model_run_is_a_full_run(name, fused):
    """The docs render their whole-model tables from ``docs/models.json``,
    ``docs/models_fused.json`` and ``docs/models_fused_all_threads.json``: full runs',
    unfused and fused (one thread, and every thread of the machine)."""
    from pathlib import Path

    from curvgap.benchmarks.models import markdown

    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "docs" / f"{name}.json").read_text())
    assert not results["quick"] and bool(results.get("fused")) == fused
    assert all(bool(row.get("fused")) == fused for row in results["rows"])
    assert markdown(results).count("\n| ") == len(results["rows"]) + 1
    assert ("First calls" in markdown(results)) == fused
    threads = int(results["device"].split()[0])
    assert threads > 1 if name.endswith("all_threads") else threads == 1


def test_the_readme_shows_the_committed_accuracy_run():
    from pathlib import Path

    from curvgap.benchmarks.accuracy import table

    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "docs" / "accuracy.json").read_text())
    assert table(results) in (root / "README.md").read_text()
