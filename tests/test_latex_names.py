"""A module's formulas in its own names: parameters, sizes and intermediates as a researcher
would write them, no symbol the engine made up, a document that compiles cleanly, and
``names=`` overriding any symbol."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from families import D_FF, DTYPE, D, DifferentialAttention, GatedResidual, PreNormBlock, gpt2_block
from matrix_forms import assert_matrix_forms
from reference import Reference, randomise, relative

import curvgap
from curvgap.adapters.formulas import module_statements
from curvgap.cli import main
from curvgap.codegen.backends.latex import pdf as pdf_module
from curvgap.derivations import evaluate, sizes
from curvgap.derivations.derivation import derive

PDFLATEX = shutil.which("pdflatex")

#: what an engine-made symbol looks like: an ATen operation's name, an engine prefix, a size
#: named by its value, a selection table
ENGINE_MADE = re.compile(
    r"\\mathrm\{(linear|chunk|matmul|mul|sub|add|addmm|split|softmax|layer|dg|dgc|div|"
    r"sigmoid|select|scores|norm\w*v)\w*\}|\\mathrm\{\w*(v(X|params)|weight|bias)\}|n_\{\d|\[c_|"
    r"\\operatorname\{(addmm|linear|matmul|mul|add|f)\}")


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _blocks() -> dict[str, tuple[torch.nn.Module, torch.Tensor, list[str]]]:
    """Each block, its input, and symbols its document must use."""
    gpt2 = gpt2_block()
    return {
        "differential attention": (randomise(DifferentialAttention(D, 3).to(DTYPE)), _x(),
                                   [r"W_{q}", r"\lambda", r"d_k", r"Q_{1}", r"K_{2}",
                                    r"A_{2}", r"e_{1}"]),
        "gated residual": (randomise(GatedResidual(D, D_FF).to(DTYPE)), _x(),
                           [r"W_{\mathrm{gate}}", r"b_{\mathrm{gate}}", r"W_{\mathrm{f0}}"]),
        "pre-norm block": (randomise(PreNormBlock(D, 3).to(DTYPE)), _x(),
                           [r"W_{q}", r"W_{o}", r"\tau", r"\mathrm{gate}",
                            r"\gamma_{\mathrm{norm}}", r"d_k", r"\mu", r"A"]),
        "GPT-2 block": (gpt2.module, gpt2.X,
                        [r"\gamma_{\mathrm{ln1}}", r"W_{\mathrm{attn}}", r"h \times d_k",
                         r"d_{ff}", r"$Q$", r"\operatorname{gelu-tanh}", r"\sqrt{\pi}",
                         r"0.044715"]),
    }


BLOCKS = ["differential attention", *(pytest.param(name, marks=pytest.mark.slow) for name in
                                      ("gated residual", "pre-norm block", "GPT-2 block"))]


@pytest.mark.parametrize("name", BLOCKS)
def test_a_modules_document_is_written_in_its_names(name, tmp_path):
    module, X, expected = _blocks()[name]
    tex = curvgap.curvature(module).latex(X)
    assert not ENGINE_MADE.search(tex), sorted(set(m.group(0) for m in ENGINE_MADE.finditer(tex)))
    missing = [symbol for symbol in expected if symbol not in tex]
    assert not missing, missing
    title = re.search(r"\\title\{(.*)\}", tex).group(1)
    assert title.count(type(module).__name__) == 1, title
    # no section without a subsection or a formula under it
    bodies = re.split(r"\\section\{", tex)[2:]
    assert all(re.search(r"\\subsection|\\begin\{", b) for b in bodies)
    if PDFLATEX:
        (tmp_path / "block.tex").write_text(tex)
        for _ in range(2):
            run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error",
                                  "block.tex"], cwd=tmp_path, capture_output=True, text=True)
            assert run.returncode == 0, run.stdout[-2000:]
        assert "Undefined control sequence" not in run.stdout
        assert "Overfull \\hbox" not in run.stdout, [
            line for line in run.stdout.splitlines() if "Overfull" in line][:5]


def test_names_override_symbols_and_sizes():
    module, X, _ = _blocks()["differential attention"]
    c = curvgap.curvature(module)
    tex = c.latex(X, names={"q.weight": r"W_{Q}", "lam": r"\lambda_1", "softmax": "P", "m": 3})
    assert r"W_{Q}" in tex and r"W_{q}" not in tex
    assert r"\lambda_{1}" in tex or r"\lambda_1" in tex
    assert r"$P$ & $L \times L$" in tex
    assert r"L \times m" in tex and "d_k" not in tex
    # a derived symbol follows its tensor's: the derivative along W_Q
    assert r"^{W_{Q}}" in tex
    # the sizes table says where each size's symbol comes from
    sizes = tex.split(r"\subsection*{Sizes}")[1].split(r"\end{longtable}")[0]
    assert "$m$ & 3 & \\texttt{names=}" in sizes and "$d$ & 8 & the input's shape" in sizes
    default = c.latex(X).split(r"\subsection*{Sizes}")[1].split(r"\end{longtable}")[0]
    assert "$d_k$ & 3 & \\texttt{d\\_k}" in default


@pytest.mark.parametrize("names, message", [
    ({"no_such.weight": "W"}, "names: 'no_such.weight' names no tensor of this module"),
    ({"q.weight": "W_{q"}, "names['q.weight']: expected a LaTeX symbol"),
    ({"q.weight": 3.5}, "names['q.weight']: expected a LaTeX symbol (str) or a size (int)"),
    ({"d_k": 99}, "names: the size 'd_k' = 99: expected one of the module's sizes"),
    ("W_q", "names: expected a dict of symbols, got str"),
])
def test_bad_names_are_refused_by_name(names, message):
    module, X, _ = _blocks()["differential attention"]
    with pytest.raises(ValueError) as error:
        curvgap.curvature(module).latex(X, names=names)
    assert message in str(error.value)


@pytest.mark.skipif(PDFLATEX is None, reason="pdflatex missing")
def test_latex_compiles_into_a_pdf(tmp_path):
    module, X, _ = _blocks()["gated residual"]
    target = tmp_path / "gated.pdf"
    tex = curvgap.curvature(module).latex(X, pdf=target)
    assert tex.startswith(r"\documentclass")
    assert target.read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gated.pdf"]


def test_latex_without_pdflatex_says_so(tmp_path, monkeypatch):
    module, X, _ = _blocks()["gated residual"]
    monkeypatch.setattr(pdf_module.shutil, "which", lambda name: None)
    with pytest.raises(pdf_module.PdfError, match="pdf: compiling needs pdflatex, which is "
                                                  "not installed"):
        curvgap.curvature(module).latex(X, pdf=tmp_path / "x.pdf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", BLOCKS)
def test_every_matrix_form_of_a_modules_document_equals_its_index_form(name):
    """As for the shipped configs (``test_latex.py``): each matrix form, evaluated with
    explicit Kronecker, commutation and diag matrices at the module's sizes, equals the
    engine's index form entry by entry."""
    module, X, _ = _blocks()[name]
    _, _, traced, _ = curvgap.curvature(module)._prepared(X, None, {}, needs_target=False)
    program = dataclasses.replace(traced.trace.programs[0], scope="all")
    der = derive(program)
    dims = {symbol: X.shape[1] if value is None else value
            for symbol, (_, value) in zip(program.dims().values(), program.sizes, strict=True)}
    dims[sizes.R] = 3  # the columns of a matrix of directions
    rng = np.random.default_rng(0)
    values = {t.name: rng.standard_normal([int(s.subs(dims)) for s in t.shape])
              for t in der.graph.tensors.values()
              if t.role in ("input", "param", "target", "direction", "constant")}
    values = evaluate.evaluate(der.graph, der.graph.assigns, values, dims)
    # entries that cancel in sums of thousands of products of size 1e3: to rounding of the
    # largest entry
    checked = assert_matrix_forms(der, values, dims, atol_of_largest=True)
    assert checked >= 20


def test_cli_typesets_a_module_given_as_its_class(tmp_path, capsys):
    args = ["latex", "families:DifferentialAttention", "--args", '{"d": 8, "d_k": 3}',
            "--shape", "2,5,8", "--out", str(tmp_path)]
    assert main(args + (["--pdf"] if PDFLATEX else [])) == 0
    tex = (tmp_path / "DifferentialAttention.tex").read_text()
    assert r"W_{q}" in tex and r"\lambda" in tex and not ENGINE_MADE.search(tex)
    if PDFLATEX:
        assert (tmp_path / "DifferentialAttention.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("extra, message", [
    (["--args", '{"d": 8', "--shape", "2,5,8"], "--args: expected the constructor's keyword "
                                                "arguments as a JSON object"),
    (["--args", "[8, 3]", "--shape", "2,5,8"], "--args: expected a JSON object"),
    (["--args", '{"d": 8}', "--shape", "2,5,8"], "--args: DifferentialAttention(**{'d': 8}) "
                                                 "failed: TypeError"),
    (["--args", '{"d": 8, "d_k": 3}'], "--shape: a module needs its input's shape"),
    (["--args", '{"d": 8, "d_k": 3}', "--shape", "2,x"], "--shape: expected two or more "
                                                          "positive integers"),
])
def test_cli_refuses_a_module_it_cannot_build_by_name(extra, message, tmp_path, capsys):
    code = main(["latex", "families:DifferentialAttention", *extra, "--out", str(tmp_path)])
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, message", [
    ("families:NoSuchBlock", "NAME: cannot find 'families:NoSuchBlock'"),
    ("os:getcwd", "NAME: expected a torch.nn.Module class"),
    ("families:Bad-Name", "NAME: expected a module as package.module:Class"),
])
def test_cli_refuses_what_is_no_module_class(name, message, tmp_path, capsys):
    assert main(["latex", name, "--shape", "2,5,8", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # a GPT-2 block read and typeset: 25 s
def test_the_readme_shows_lines_its_example_writes():
    """The README's two lines of LaTeX come out of its own quick start's ``c.latex(X)``."""
    transformers = pytest.importorskip("transformers")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (shown,) = re.findall(r"^```latex\n(.*?)^```", readme, re.M | re.S)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_inner=64)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config).to(DTYPE).eval()
    tex = curvgap.curvature(block).latex(torch.randn(2, 8, 32, dtype=DTYPE))
    for line in shown.strip().splitlines():
        assert line in tex.splitlines(), line


def test_statements_for_a_web_page_are_the_documents_own():
    """The docs' formulas page: the symbols, the architecture and the loss-Hessian blocks of
    the document, in display math MathJax reads (no LaTeX-only command), nothing of the
    appendix."""
    module, X, _ = _blocks()["differential attention"]
    c = curvgap.curvature(module)
    page = module_statements(c, X)
    tex = c.latex(X)
    displays = re.findall(r"^\$\$\n\\begin\{aligned\}\n(.*?)\n\\end\{aligned\}\n\$\$$", page,
                          re.M | re.S)
    assert page.count("$$") == 2 * len(displays) and len(displays) >= 10
    statement = r"H^{\mathrm{GN}}_{W_{q},W_{k}} &= \frac{2}{L d} J_{W_{q}}^{\top} J_{W_{k}}"
    assert statement in page and statement in tex
    assert "### Loss Hessian" in page and "First derivatives" not in page
    assert not re.search(r"\\(notag|label|texttt|begin\{align\})", page)
    assert "| $W_{q}$ | $2 \\times d_k \\times d$ | parameter | `q.weight` |" in page


class Clashing(torch.nn.Module):
    """Names that invite clashes: a linear map called ``t`` (the target is ``T``), applied
    twice; a ``hidden_size`` that is not the input's width."""

    def __init__(self) -> None:
        super().__init__()
        self.t, self.up, self.down = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 6),
                                      torch.nn.Linear(6, 4))
        self.hidden_size = 6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.t(self.t(x)))))


class LossNamed(torch.nn.Module):
    """Parameters named as the derivation names the target and the loss's nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.D, self.T, self.ell, self.ce_w = (torch.nn.Parameter(torch.randn(4))
                                               for _ in range(4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.D + self.T * self.ell - self.ce_w


def test_parameters_named_as_the_losss_nodes_are_derived_exactly():
    """A parameter ``D`` (Mamba's skip weight) or ``T`` stopped the derivation with "D
    declared twice"; it is a parameter like any other."""
    module = randomise(LossNamed().to(DTYPE))
    generator = torch.Generator().manual_seed(0)
    X, T = (torch.randn(2, 3, 4, generator=generator, dtype=DTYPE) for _ in range(2))
    c = curvgap.curvature(module)
    assert relative(c.gradient(X, T), Reference(module, X, T).gradient()) <= 1e-10
    labels = torch.randint(0, 4, (2, 3), generator=generator)  # the ce_* nodes too
    ce = curvgap.curvature(module, loss="cross_entropy")
    assert relative(ce.gradient(X, labels), Reference(module, X, labels, loss="cross_entropy")
                    .gradient()) <= 1e-10


def _symbol_rows(tex: str) -> list[list[str]]:
    table = tex.split(r"\subsection*{Symbols}")[1].split(r"\end{longtable}")[0]
    return [row.split(" & ") for row in table.splitlines() if row.startswith("$")]


@pytest.mark.parametrize("module", [Clashing(), torch.nn.LayerNorm(4), LossNamed()],
                         ids=["clashing names", "a top-level norm", "named as the loss's"])
def test_no_two_tensors_share_a_symbol(module):
    X = torch.randn(2, 3, 4, dtype=DTYPE)
    tex = curvgap.curvature(module.to(DTYPE)).latex(X)
    rows = _symbol_rows(tex)
    symbols = [row[0] for row in rows]
    assert len(symbols) == len(set(symbols)), symbols
    assert [row[2] for row in rows if row[0] == "$T$"] == ["target"]
    assert r"\mathrm{}" not in tex and "_{}" not in tex
    if isinstance(module, Clashing):  # hidden_size = 6 is not the input's width d = 4
        assert r"$W_{\mathrm{up}}$ & $6 \times d$" in tex


def test_names_that_would_share_a_symbol_are_refused():
    module, X, _ = _blocks()["differential attention"]
    c = curvgap.curvature(module)
    with pytest.raises(ValueError, match=r"names\['q.weight'\]: 'W_\{k\}' is the symbol of "
                                         "another tensor"):
        c.latex(X, names={"q.weight": "W_k"})
    with pytest.raises(ValueError, match=r"names\['lam'\]: expected a LaTeX symbol"):
        c.latex(X, names={"lam": r"\input{secrets}"})


def test_no_size_shares_a_tensors_letter():
    """The vocabulary's size is not ``V`` (the attention's values): every conventional size
    symbol differs from the letters intermediates are named by."""
    from curvgap.codegen.backends.latex.names import SIZE_ATTRIBUTES, size_hints

    assert size_hints({"vocab_size": 50, "num_heads": 2}) == {r"n_{\mathrm{vocab}}": 50, "h": 2}
    assert not {"V", "Q", "K", "A", "S", "N", "C", "Y", "E"} & set(SIZE_ATTRIBUTES)
