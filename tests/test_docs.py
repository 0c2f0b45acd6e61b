"""The documentation site builds offline with warnings as errors, every gallery example
executed with its figures (``-m slow``: the gallery runs every example)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import extra_module

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("plot_*.py"))


def test_the_gallery_has_the_tutorials():
    names = {path.stem for path in EXAMPLES}
    assert {"plot_block_hessian", "plot_regenerate_variant", "plot_hf_eigenvalues",
            "plot_exact_diagonal", "plot_kronecker_spectrum", "plot_dataset_torchrun",
            "plot_paper_analyses", "plot_padded_dataset"} <= names


@pytest.mark.slow
def test_the_site_builds_with_every_example_run(tmp_path):
    for module in ("sphinx", "sphinx_gallery", "myst_parser", "furo"):
        extra_module(module)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
                            "docs", str(tmp_path / "html")], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    for example in EXAMPLES:
        assert (tmp_path / "html" / "auto_examples" / f"{example.stem}.html").exists()
        figures = list((ROOT / "docs" / "auto_examples" / "images").glob(
            f"sphx_glr_{example.stem}_*.png"))
        assert figures, f"{example.name} made no figure"
    for page in ("index", "api", "cli", "why_exact", "guide/gpu", "guide/memory",
                 "guide/formulas"):
        assert (tmp_path / "html" / f"{page}.html").exists()
