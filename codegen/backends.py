"""Backends in the manner of SymForce's: a printer, a small config, a templates folder.

``numpy`` and ``torch`` write modules (the derivation lowered to einsum programs);
``latex`` writes a document of the derived formulas (:mod:`codegen.document`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sympy.printing.printer import Printer

from .latex import LatexPrinter
from .printers import NumpyPrinter, TorchPrinter

#: The codegen modules that shape a module (lowered code) and a document (formulas).
_CODE_SOURCES = ("lowering.py", "calls.py", "ir.py", "printers.py")
_DOCUMENT_SOURCES = ("latex.py", "document.py")


@dataclass(frozen=True)
class Backend:
    name: str                   # also the folder under templates/ and generated/
    printer: type[Printer]
    template: str = "module.py.jinja"
    suffix: str = ".py"
    comment: str = "#"          # starts the lines of the generated-file header
    #: the codegen modules and template folders its files depend on (with the engine in
    #: derivations/, codegen's generate.py and backends.py): they make up its source hash
    modules: tuple[str, ...] = _CODE_SOURCES
    templates: tuple[str, ...] = ("common",)


CODE_BACKENDS = (Backend("numpy", NumpyPrinter, templates=("common", "numpy")),
                 Backend("torch", TorchPrinter, templates=("common", "torch")))
LATEX = Backend("latex", LatexPrinter, "document.tex.jinja", ".tex", "%",
                modules=_DOCUMENT_SOURCES, templates=("latex",))
BACKENDS = (*CODE_BACKENDS, LATEX)
