"""The LaTeX export: matrix forms proven numerically, documents that compile."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp
import torch
from conftest import SHIPPED, as_numpy, generated_module, to_backend
from matrix_forms import assert_matrix_forms

from curvgap.cli import main
from curvgap.codegen.backends.latex import BACKEND as LATEX
from curvgap.codegen.backends.latex import document, latex
from curvgap.codegen.backends.latex.document import _notation, builder_for
from curvgap.codegen.generate import render
from curvgap.codegen.resources import GENERATED
from curvgap.derivations import evaluate, matrixform, sizes
from curvgap.derivations.derivation import derive

DIMS = {"L": 3, "d": 4, "d_k": 2, "d_ff": 5, "p": 6, "c": 7, "R": 2}
PDFLATEX = shutil.which("pdflatex")
# CI installs texlive and sets this, so that a missing pdflatex fails instead of skipping
REQUIRE_PDFLATEX = os.environ.get("CURVGAP_REQUIRE_PDFLATEX") == "1"


def _sizes(config) -> dict:
    h = config.heads
    return {sizes.L: DIMS["L"], sizes.d: DIMS["d"], sizes.d_k: DIMS["d_k"],
            sizes.d_ff: DIMS["d_ff"], sizes.h: h, sizes.d_v: DIMS["d"] // h,
            sizes.R: DIMS["R"], sizes.c: DIMS["c"], sizes.p: DIMS["p"], sizes.n_1: 1}


def _sample_values(der, dims, rng, given: dict | None = None) -> dict:
    """Random (or ``given``) inputs of one sample, and every assignment evaluated by the
    engine's direct evaluator (index form, shared with nothing under test here)."""
    values = dict(given or {})
    for tensor in der.graph.tensors.values():
        if tensor.role in ("input", "param", "target", "direction") and tensor.name not in values:
            shape = [int(s.subs(dims)) for s in tensor.shape]
            values[tensor.name] = rng.standard_normal(shape)
    if der.config.loss == "cross_entropy":  # one-hot rows over the output's last axis
        *rows, classes = (int(s.subs(dims)) for s in der.graph.tensors["T"].shape)
        values["T"] = np.eye(classes)[rng.integers(0, classes, rows)]
    return evaluate.evaluate(der.graph, der.graph.assigns, values, dims)


@pytest.mark.parametrize("name", ["self_attention", "layernorm_affine", "ffn", "paper_block",
                                  "classifier_head",  # a cross-entropy
                                  pytest.param("gpt2_block", marks=pytest.mark.slow)])  # 15 s
def test_every_matrix_form_equals_its_index_form(name):
    """Each formula the document shows in matrix form, evaluated with explicit Kronecker,
    commutation and diag matrices, equals the index form entry by entry."""
    der = derive(SHIPPED[name])
    dims = _sizes(der.config)
    values = _sample_values(der, dims, np.random.default_rng(0))
    checked = assert_matrix_forms(der, values, dims)
    assert checked >= 30


def test_gauss_newton_VV_of_self_attention_is_a_kronecker_product():
    """``H^GN_{V,V} = (2/(L d)) (Ḟ^V)^T Ḟ^V ⊗ I_d`` with ``Ḟ^V = A X``, as in the paper."""
    der = derive(SHIPPED["self_attention"])
    builder = builder_for(der, _notation(der))
    (assign,) = [a for a in der.graph.assigns if a.target.name == "gauss_newton_W_V_W_V"]
    form = builder.matrix(assign)[2]
    assert isinstance(form, matrixform.MatScaled) and isinstance(form.arg, matrixform.MatKron)
    assert form.arg.args[-1] == matrixform.MatIdentity(sizes.d)
    text = (GENERATED / "latex" / "self_attention.tex").read_text()
    assert (r"H^{\mathrm{GN}}_{W_{V},W_{V}} &= \frac{2}{L d} \left(\left(\dot{F}^{W_{V}}"
            r"\right)^{\top} \dot{F}^{W_{V}}\right) \otimes I_{d}") in text
    (tangent,) = [a for a in der.graph.assigns if a.target.name == "dF_W_V"]
    assert latex(builder.matrix(tangent)[2]) == "A X"


@pytest.mark.parametrize(("name", "output", "method"), [
    ("self_attention", "gauss_newton_W_V_W_V", "gauss_newton"),
    ("self_attention", "jacobian_W_V", "jacobian"),
    ("ffn", "jacobian_W_1", "jacobian"),
    ("paper_block", "jacobian_W_2", "jacobian"),
])
def test_printed_matrix_form_equals_generated_code(name, output, method, backend):
    """The printed formula of an output, with its Kronecker products and identities built
    at a tiny size, gives the generated module's numbers (batch of 2)."""
    config = SHIPPED[name]
    der = derive(config)
    dims = _sizes(config)
    builder = builder_for(der, _notation(der))
    (assign,) = [a for a in der.graph.assigns if a.target.name == output]
    rows, cols, form = builder.matrix(assign)
    assert form is not None
    rng = np.random.default_rng(1)
    wrt = output[len("jacobian_"):] if method == "jacobian" else "W_V"
    params = {p.name: rng.standard_normal([int(s.subs(dims)) for s in p.shape])
              for p in der.params}
    X = rng.standard_normal((2, DIMS["L"], DIMS["d"]))
    T = rng.standard_normal((2, DIMS["L"], DIMS["d"]))
    printed = []
    for b in range(2):
        values = _sample_values(der, dims, rng, {**params, "X": X[b], "T": T[b]})
        printed.append(form.evaluate(values, dims))
    module = generated_module(name, backend)
    tensors = to_backend(backend, {k: torch.from_numpy(v) for k, v in params.items()})
    X_, T_ = (to_backend(backend, torch.from_numpy(a)) for a in (X, T))
    if method == "jacobian":
        np.testing.assert_allclose(as_numpy(module.jacobian(tensors, X_, wrt)),
                                   np.stack(printed), rtol=1e-11, atol=1e-12)
    else:
        got = module.loss_hessian(tensors, X_, T_, wrt=wrt, part="gauss_newton")
        np.testing.assert_allclose(as_numpy(got), np.mean(printed, axis=0), rtol=1e-11,
                                   atol=1e-12)


def test_latex_api():
    der = derive(SHIPPED["self_attention"])
    (assign,) = [a for a in der.graph.assigns if a.target.name == "F"]
    assert latex(assign.expr) == r"\sum_{a} A_{ia} V_{aj}"
    text = document(SHIPPED["layernorm"])
    assert text.startswith(r"\documentclass") and r"\end{document}" in text
    assert "Formulas in the paper's matrix form:" in text
    assert text == (GENERATED / "latex" / "layernorm.tex").read_text().split("\n", 3)[3]


def test_an_elementwise_factor_that_is_negative_or_a_sum_is_parenthesised():
    """``A_ij · (−1/(2 v_i^{3/2}))`` must not print as ``A_ij − 1/(2 v_i^{3/2})`` (a new
    term), nor ``A_ij · (1 + v_i)`` as ``A_ij 1 + v_i``."""
    from curvgap.derivations.functions import ScalarFn
    from curvgap.derivations.functions import x as variable
    from curvgap.derivations.indexform import Apply, Expr, Index, Ref, Term

    i, j = Index("i", sizes.L), Index("j", sizes.d)
    for fn, inner in ((ScalarFn("g", -1 / (2 * variable ** sp.Rational(3, 2))), r"- \frac"),
                      (ScalarFn("h", 1 + variable), "v_{i} + 1")):
        term = Term(sp.Integer(1), (Ref("A", (i, j)), Apply(fn, "v", (i,))))
        text = latex(Expr([term], (i, j)))
        assert rf"A_{{ij}} \left({inner}" in text, text


def _compile(tex_dir, name) -> str:
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error",
                          f"{name}.tex"], cwd=tex_dir, capture_output=True, text=True,
                         timeout=300)
    log = run.stdout
    assert run.returncode == 0, log[-3000:]
    return log


@pytest.mark.skipif(PDFLATEX is None and not REQUIRE_PDFLATEX,
                    reason="pdflatex is not installed (apt-get install texlive-latex-base "
                           "texlive-latex-recommended)")
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_documents_compile_cleanly(name, tmp_path):
    """No error, no undefined control sequence, nothing overflowing the page."""
    shutil.copy(GENERATED / "latex" / f"{name}.tex", tmp_path)
    log = _compile(tmp_path, name)
    assert "Undefined control sequence" not in log
    assert "Overfull \\hbox" not in log, [line for line in log.splitlines()
                                          if "Overfull" in line][:5]
    assert (tmp_path / f"{name}.pdf").stat().st_size > 10_000


@pytest.mark.skipif(PDFLATEX is None and not REQUIRE_PDFLATEX, reason="pdflatex missing")
def test_cli_latex_writes_and_compiles(tmp_path, capsys):
    assert main(["latex", "ffn", "--out", str(tmp_path), "--pdf"]) == 0
    # only the document and its PDF: pdflatex's .aux, .log and .toc stay in its own folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ffn.pdf", "ffn.tex"]
    assert (tmp_path / "ffn.tex").read_text() == render(derive(SHIPPED["ffn"]), LATEX)
    assert main(["latex", "no_such_config", "--out", str(tmp_path)]) == 2
    assert "NAME: expected a shipped config name" in capsys.readouterr().err
