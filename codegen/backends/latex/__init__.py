"""The LaTeX backend: a document of every derived formula, in index form and, where the
structure is recognised, in the paper's matrix form (:mod:`.document`); :func:`latex`
prints one expression."""

from __future__ import annotations

from typing import Any

from ....derivations.config import Config
from ....derivations.derivation import Derivation, derive
from ....derivations.program import Program
from ..backend import Backend
from .document import document_context
from .printer import LatexPrinter, latex

BACKEND = Backend(
    name="latex", printer=LatexPrinter, context=document_context,
    template="document.tex.jinja", templates=("latex",), sources=("backends/latex",),
    suffix=".tex", comment="%",
    delimiters=dict(block_start_string="<%", block_end_string="%>",
                    variable_start_string="<<", variable_end_string=">>",
                    comment_start_string="<#", comment_end_string="#>"),
)


def document(source: Config | Program | Derivation, **options: Any) -> str:
    """The LaTeX document of a config or a module's program (or of its derivation), without
    the generated-file header; ``options`` (a program's ``attributes`` and ``names``) go to
    :func:`.document.document_context`."""
    der = source if isinstance(source, Derivation) else derive(source)
    return BACKEND.render(der, **options)


__all__ = ["BACKEND", "document", "latex"]
