"""What changes in the formulas when the architecture changes (``curvgap.formula_diff``):
formulas aligned and paired by their left-hand sides, each Hessian block new, gone, changed
(in the derivatives it reads) or the same as the mathematics says, a document that compiles
without an overfull line, and the command line's refusals."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from families import DTYPE

import curvgap
from curvgap.cli import main
from curvgap.codegen.backends.latex.diff import Row, side_by_side
from curvgap.codegen.backends.latex.document import Formula
from curvgap.codegen.backends.latex.pdf import compile_pdf
from curvgap.codegen.resources import CONFIGS
from curvgap.derivations.config import load

PDFLATEX = shutil.which("pdflatex")


def _formula(lhs: str, rhs: str) -> Formula:
    return Formula(lhs, [rhs], lhs, [rhs], "1", "")


def _compiles_cleanly(tex: str, tmp_path: Path) -> None:
    if PDFLATEX is None:
        if os.environ.get("CURVGAP_REQUIRE_PDFLATEX"):
            pytest.fail("pdflatex is required (CURVGAP_REQUIRE_PDFLATEX) and missing")
        pytest.skip("pdflatex is not installed")
    log = compile_pdf(tex, tmp_path / "diff.pdf")
    assert "Overfull \\hbox" not in log, [line for line in log.splitlines()
                                          if "Overfull" in line][:5]


def test_formulas_are_aligned_and_paired_by_their_left_hand_sides():
    a = [_formula(n, f"{n}_0") for n in "ABCDEFGH"]
    b = [_formula("N", "n")] + [_formula(n, f"{n}_0") for n in "ABCDEFG"]
    b[4] = _formula("D", "changed")  # D changed, H gone, N new
    rows = side_by_side(a, b)
    assert [r.mark for r in rows] == ["new", "same", "same", "same", "changed", "same",
                                      "same", "same", "gone"]
    assert rows[4] == Row("changed", ("D = D_0",), ("D = changed",))
    collapsed = side_by_side(a, b, context=0)  # A B C and E F G left out
    assert [r.mark for r in collapsed] == ["new", "skipped", "changed", "skipped", "gone"]
    assert collapsed[1].count == collapsed[3].count == 3
    assert side_by_side(a, b, context=1)[1:4] == rows[1:4]  # a run of 3 stays whole


def _encoder(activation: str = "relu", norm_first: bool = False) -> torch.nn.Module:
    return torch.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True,
                                            activation=activation, norm_first=norm_first
                                            ).to(DTYPE).eval()


@pytest.mark.slow
def test_relu_to_gelu_changes_only_what_reads_the_activation(tmp_path):
    X = torch.randn(2, 5, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    tex = curvgap.formula_diff(_encoder("relu"), _encoder("gelu"), X, labels=("ReLU", "GELU"))
    # Z = LN2(Y + W_2 act(W_1 Y + b_1) + b_2): the Jacobians of b_2 and of the last norm do
    # not pass through the activation, every other parameter's does
    unchanged = tex.split(r"The output Jacobian $J_V$ is the same for $V$ = ")[1].split(".\n")[0]
    assert unchanged == (r"$b_{\mathrm{linear2}}$, $\gamma_{\mathrm{norm2}}$, "
                         r"$\beta_{\mathrm{norm2}}$")
    changed = tex.split(r"The output Jacobian $J_V$ changed for $V$ = ")[1].split(".\n")[0]
    assert r"W_{\mathrm{linear1}}" in changed and r"W_{\mathrm{in}}" in changed
    assert "Of the 91 blocks, 85 changed, 0 are new, 0 gone and 6 the same." in tex
    # the one architecture line that changed is the activation's
    architecture = tex.split(r"\section{Architecture}")[1].split(r"\section{")[0]
    marked = [line for line in architecture.splitlines() if line.startswith("$\\ne$")]
    assert len(marked) == 1 and r"\max\left(0" in marked[0] and "tanh" not in marked[0]
    _compiles_cleanly(tex, tmp_path)


class Residual(torch.nn.Module):
    """``x + f(x)``, or with ``gated`` ``x + σ(x W_g + b_g) ∘ f(x)``; ``f`` a ReLU MLP."""

    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(),
                                     torch.nn.Linear(12, 8))
        self.gate = torch.nn.Linear(8, 8) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f(x)
        return x + (y if self.gate is None else torch.sigmoid(self.gate(x)) * y)


def test_a_gate_added_gives_new_blocks_and_changes_every_jacobian(tmp_path):
    X = torch.randn(2, 5, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    plain, gated = Residual(False).to(DTYPE), Residual(True).to(DTYPE)
    tex = curvgap.formula_diff(plain, gated, X, labels=("plain", "gated"))
    # four parameters and X before, six and X after: 15 blocks in both, 13 new
    assert "Of the 28 blocks, 15 changed, 13 are new, 0 gone and 0 the same." in tex
    assert (r"The output Jacobian $J_V$ is new for $V$ = $W_{\mathrm{gate}}$, "
            r"$b_{\mathrm{gate}}$.") in tex
    grid = tex.split(r"\begin{longtable}{l|")[1].split(r"\end{longtable}")[0]
    row = next(line for line in grid.splitlines() if line.startswith(r"$W_{\mathrm{gate}}$"))
    assert row.count("$+$") == 3  # its blocks with b_gate, X and itself
    md = curvgap.formula_diff(plain, gated, X, markdown=True)
    assert "| + |  | $" in md and "13 are new" in md
    same = curvgap.formula_diff(plain, Residual(False).to(DTYPE), X)
    assert "Of the 15 blocks, 0 changed, 0 are new, 0 gone and 15 the same." in same
    assert r"\ne" not in same.split(r"\section{Architecture}")[1]
    _compiles_cleanly(tex, tmp_path)


def test_post_ln_to_pre_ln_configs(tmp_path):
    post = load(CONFIGS / "paper_block.toml")
    pre = dataclasses.replace(post, norm_position="pre", name="paper_block_pre")
    tex = curvgap.formula_diff(post, pre)
    assert "What changes from paper\\_block to paper\\_block\\_pre" in tex
    assert "Of the 21 blocks, 21 changed" in tex
    architecture = tex.split(r"\section{Architecture}")[1].split(r"\section{")[0]
    rows = [line for line in architecture.splitlines() if " & " in line and "textbf" not in line]
    # pre-LN normalises X before the projections: its first rows are new, Q = X W_Q changed
    assert rows[0].startswith("$+$ &  & $\\mu^{(1)}")
    assert any(r.startswith("$\\ne$ & $Q = X W_{Q}$ & $Q = N_{1} W_{Q}$") for r in rows)
    _compiles_cleanly(tex, tmp_path)


def test_a_new_loss_changes_the_blocks_statements_not_the_jacobians():
    mse = load(CONFIGS / "ffn.toml")
    tex = curvgap.formula_diff(mse, dataclasses.replace(mse, loss="cross_entropy", name="ce"))
    assert "The output Jacobian $J_V$ is the same for $V$ = $W_{1}$, $W_{2}$, $X$." in tex
    assert "changed for" not in tex and r"\section{First derivatives}" not in tex
    grid = tex.split(r"\begin{longtable}{l|")[1].split(r"\end{longtable}")[0]
    assert grid.count("$H$") == 6 and "J" not in grid.replace("$W_{1}$", "")


class UpDown(torch.nn.Module):
    """``x + W_down relu(W_up x)``, its two maps registered in either order."""

    def __init__(self, up_first: bool) -> None:
        super().__init__()
        for name in ("up", "down") if up_first else ("down", "up"):
            setattr(self, name, torch.nn.Linear(8, 12) if name == "up" else
                    torch.nn.Linear(12, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_parameters_in_another_order_are_not_a_change_of_mathematics():
    X = torch.randn(2, 5, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    tex = curvgap.formula_diff(UpDown(True).to(DTYPE), UpDown(False).to(DTYPE), X)
    assert "Of the 15 blocks, 4 changed, 0 are new, 0 gone and 11 the same." in tex
    grid = tex.split(r"\begin{longtable}{l|")[1].split(r"\end{longtable}")[0]
    assert grid.count(r"$\top$") == 4 and "J" not in grid.replace("$W_", "")


def test_bad_arguments_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="X: a module's formulas need its input"):
        curvgap.formula_diff(Residual(False), Residual(True))
    with pytest.raises(ValueError, match="b: expected a torch.nn.Module"):
        curvgap.formula_diff("paper_block", 3)
    with pytest.raises(ValueError, match="labels: expected two strings"):
        curvgap.formula_diff("paper_block", "paper_block", labels=("one",))
    with pytest.raises(ValueError, match="b: expected a shipped config name .* got 'nope'"):
        curvgap.formula_diff("paper_block", "nope")
    out = str(tmp_path / "out")
    for args, message in [
            (["paper_block", "nope"], "B: expected a shipped config name"),
            (["torch.nn:Nope", "paper_block", "--shape", "2,3,4"],
             "A: cannot find 'torch.nn:Nope'"),
            (["torch.nn:Linear", "torch.nn:Linear", "--args",
              '{"in_features": 4, "out_features": 4}', "--args-b", '{"no_such": 1}',
              "--shape", "2,3,4"], "--args-b: Linear(**{"),
            (["torch.nn:Linear", "ffn", "--args-b", "{}", "--shape", "2,3,4"],
             "--args-b: only for B given as a module"),
            (["paper_block", "torch.nn:Linear", "--args", "[1]"], "--args: expected a JSON"),
            (["paper_block", "ffn", "--shape", "2,3"], "--shape: only for a module"),
            (["paper_block", "ffn", "--labels", "x"], "--labels: expected two names"),
            (["paper_block", "torch.nn:Linear"], "--shape: a module needs its input's shape")]:
        assert main(["formula-diff", *args, "--out", out]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


def test_the_command_line_writes_and_compiles_the_comparison(tmp_path, capsys):
    pdf = ["--pdf"] if PDFLATEX or os.environ.get("CURVGAP_REQUIRE_PDFLATEX") else []
    assert main(["formula-diff", "paper_block", "paper_block_eps", "--out", str(tmp_path),
                 "--labels", "eps = 0,eps > 0", *pdf]) == 0
    tex = (tmp_path / "formula_diff.tex").read_text()
    assert "What changes from eps = 0 to eps > 0" in tex
    assert "Of the 21 blocks, 21 changed" in tex  # every Jacobian reads a norm's 1/√(var + ε)
    assert (tmp_path / "formula_diff.pdf").exists() == bool(pdf)
