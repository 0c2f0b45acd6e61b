"""Tables read from the runs that produced them, written before the pages are read.

Each ``docs/_generated/<name>.md`` is rendered from a committed result file by the function of
the code that wrote that file, so a page that includes it cannot drift from its run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from sphinx.application import Sphinx

DOCS = Path(__file__).resolve().parents[1]


def _accuracy() -> str:
    from curvgap.benchmarks.accuracy import table

    return table(json.loads((DOCS / "accuracy.json").read_text()))


def _models(name: str = "models") -> str:
    from curvgap.benchmarks.models import markdown

    return markdown(json.loads((DOCS / f"{name}.json").read_text()))


def _latex() -> str:
    """How many formulas of each shipped document are in matrix form, as the document
    itself states it."""
    from curvgap.codegen.resources import GENERATED

    rows = ["| config | formulas in matrix form |", "| --- | ---: |"]
    for path in sorted((GENERATED / "latex").glob("*.tex")):
        found = re.search(r"matrix form: (\d+) of (\d+);", path.read_text())
        if found is None:
            raise ValueError(f"{path} does not state its matrix-form count")
        shown, total = map(int, found.groups())
        rows.append(f"| `{path.stem}` | {shown} of {total} ({100 * shown / total:.0f} %) |")
    return "\n".join(rows)


def _formulas() -> str:
    """The statements of three documents, printed by the LaTeX backend's printer for MathJax:
    the paper's post-LN block (a config), the README's GPT-2 block and PyTorch's pre-LN
    encoder layer (read from their modules); then what changes from the post-LN encoder layer
    to the pre-LN one."""
    import torch
    import transformers

    import curvgap
    from curvgap.adapters.formulas import module_statements
    from curvgap.codegen.backends.latex.markdown import statements
    from curvgap.codegen.resources import CONFIGS
    from curvgap.derivations.config import load

    gpt2 = transformers.models.gpt2.modeling_gpt2.GPT2Block(
        transformers.GPT2Config(n_embd=32, n_head=4, n_inner=64)).to(torch.float64).eval()
    encoder = torch.nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True,
                                               norm_first=True).to(torch.float64).eval()
    X = torch.zeros(2, 8, 32, dtype=torch.float64)
    post = torch.nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True
                                            ).to(torch.float64).eval()
    return "\n".join([
        "## The paper's post-LN block (config `paper_block`)\n",
        statements(load(CONFIGS / "paper_block.toml")),
        "## The README's GPT-2 block (`GPT2Block`, Hugging Face)\n",
        module_statements(curvgap.curvature(gpt2), X),
        "## A pre-LN encoder layer (`torch.nn.TransformerEncoderLayer`, `norm_first=True`)\n",
        module_statements(curvgap.curvature(encoder), X[..., :16]),
        "## What changes from post-LN to pre-LN (`curvgap.formula_diff`)\n",
        "PyTorch's encoder layer with `norm_first=False` against `norm_first=True`: every "
        "block changes, since every parameter's output Jacobian now ends in the residual "
        "sum rather than in a norm; the architectures side by side show the norms moving "
        "ahead of the sublayers. The PDF (`pdf=`) adds each changed Jacobian's chain side "
        "by side.\n",
        curvgap.formula_diff(post, encoder, X[..., :16], labels=("post-LN", "pre-LN"),
                             markdown=True)])


def _cli() -> str:
    """``curvgap --help`` and each command's ``--help``, as the command prints them."""
    import argparse

    from curvgap.cli.commands import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [("curvgap", parser)] + [(f"curvgap {name}", sub)
                                     for name, sub in commands.choices.items()]
    return "\n\n".join(f"## `{title}`\n\n```text\n{sub.format_help().rstrip()}\n```"
                        for title, sub in parts)


#: the generated tables, by file name
TABLES: dict[str, Callable[[], str]] = {
    "accuracy": _accuracy,
    "models": _models,
    "models_fused": lambda: _models("models_fused"),
    "models_fused_all_threads": lambda: _models("models_fused_all_threads"),
    "cli": _cli,
    "latex": _latex,
    "formulas": _formulas,
}


def write_tables(app: Sphinx) -> None:
    """Write every table into ``docs/_generated/`` (only where its text changed)."""
    folder = DOCS / "_generated"
    folder.mkdir(exist_ok=True)
    for name, render in TABLES.items():
        path = folder / f"{name}.md"
        text = render() + "\n"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", write_tables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
