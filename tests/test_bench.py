"""``curvgap bench --quick`` as a smoke test: it runs, writes its files, and every number is
finite (no timing assertion: speed is measured, not tested)."""

from __future__ import annotations

import json
import math

from curvgap import cli


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
