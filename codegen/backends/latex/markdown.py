"""A document's statements as Markdown for a web page: the symbols, the architecture and each
loss-Hessian block in display math (MathJax), printed by the same printer as the LaTeX
document (:mod:`.document`); the appendix's derivations stay in the PDF."""

from __future__ import annotations

import re
from typing import Any

from ....derivations.config import Config
from ....derivations.derivation import Derivation, derive
from ....derivations.program import Program


def statements(source: Config | Program | Derivation, heading: str = "###",
               **options: Any) -> str:
    """The statements of ``source``'s document as Markdown, sections under ``heading``
    (``options`` as for :func:`~curvgap.codegen.backends.latex.document`)."""
    from . import BACKEND
    from .document import document_context

    der = source if isinstance(source, Derivation) else derive(source)
    context = document_context(der, BACKEND, **options)
    lines = [f"{heading} Symbols", "", "| symbol | shape | role |" + (
        " name (for `names=`) |" if context["code_names"] else ""),
             "| --- | --- | --- |" + (" --- |" if context["code_names"] else "")]
    lines += ["| " + " | ".join(_text(cell) for cell in row) + " |"
              for row in context["symbols"]]
    if context["sizes"]:
        lines += ["", "Sizes (for the input it was derived on; the formulas hold for any):", "",
                  "| size | value | named after |", "| --- | ---: | --- |"]
        lines += [f"| {symbol} | {value} | {_text(where)} |"
                  for symbol, value, where in context["sizes"]]
    if context["functions"]:
        lines += ["", "Elementwise functions:", "", _display(
            [(name, body) for name, body in context["functions"]])]
    for section in context["sections"]:
        if section.appendix:
            continue
        lines += ["", f"{heading} {section.title}", "", _text(section.text), ""]
        for block in section.blocks:
            notes = sorted({f.note for f in block.formulas if f.note})
            lines += [f"**{_text(block.title)}**" + "".join(f" ({n})" for n in notes), ""]
            lines.append(_display([(f.matrix_lhs, f.matrix_lines) if f.matrix_lines
                                   else (f.lhs, f.index_lines) for f in block.formulas]))
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _display(rows: list[tuple[str, list[str]]]) -> str:
    """Aligned equations in one display."""
    body = " \\\\\n".join(f"{lhs} &= " + " \\\\\n  &\\qquad ".join(lines) for lhs, lines in rows)
    return f"$$\n\\begin{{aligned}}\n{body}\n\\end{{aligned}}\n$$"


def _text(cell: str) -> str:
    """LaTeX text as Markdown: ``\\texttt{a\\_b}`` as code, ``\\_`` as ``_``, ``--`` a dash."""
    cell = re.sub(r"\\texttt\{(.*?)\}", lambda m: f"`{m.group(1)}`", cell)
    return cell.replace(r"\_", "_").replace("--", "–")


def diff_statements(context: dict, heading: str = "###") -> str:
    """What changes between two documents (a :func:`~.diff.diff_context`) as Markdown: the
    loss-Hessian blocks' table, then the architectures side by side."""
    marks = {"same": "", "changed": "≠", "new": "+", "gone": "−"}
    a, b = context["labels"]
    counts = context["counts"]
    lines = [f"{heading} Loss-Hessian blocks", "",
             f"Of the {len(context['blocks'])} blocks $H_{{V,W}}$, {counts['changed']} changed, "
             f"{counts['new']} are new, {counts['gone']} gone and {counts['same']} the same "
             "(row $V$, column $W$: $+$ new, $-$ gone, $\\cdot$ the same; a changed block says "
             "what it reads that changed: $J$ an output Jacobian, $\\partial^2$ the second "
             "derivative, $H$ the block's own statement, $\\top$ stated as the transpose).", "",
             "| | " + " | ".join(f"${v}$" for v in context["variables"]) + " |",
             "| --- |" + " :-: |" * len(context["variables"])]
    lines += [f"| ${v}$ | " + " | ".join(f"${c}$" if c else "" for c in row) + " |"
              for v, row in context["grid"]]
    lines += ["", f"{heading} Architecture", "",
              f"| | {_label(a)} | {_label(b)} |", "| --- | --- | --- |"]
    for row in context["architecture"].rows:
        if row.mark == "skipped":
            lines.append(f"| | *{row.count} the same in both* | |")
        else:
            lines.append(f"| {marks[row.mark]} | " + " | ".join(
                f"${_cell(' '.join(side))}$" if side else "" for side in (row.left, row.right))
                + " |")
    return "\n".join(lines) + "\n"


def _cell(tex: str) -> str:
    """LaTeX for a Markdown table's cell (a ``|`` would end the cell)."""
    return tex.replace("|", r"\vert ")


def _label(text: str) -> str:
    """A column's label in a Markdown table's header (a ``|`` would end the cell)."""
    return text.replace("|", "\\|")
