"""Backends in the manner of SymForce's: a printer, a small config, a templates folder.

``numpy`` and ``torch`` write modules (the derivation lowered to einsum programs);
``latex`` writes a document of the derived formulas (:mod:`codegen.document`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sympy.printing.printer import Printer

from .latex import LatexPrinter
from .printers import NumpyPrinter, TorchPrinter


@dataclass(frozen=True)
class Backend:
    name: str                   # also the folder under templates/ and generated/
    printer: type[Printer]
    template: str = "module.py.jinja"
    suffix: str = ".py"
    comment: str = "#"          # starts the lines of the generated-file header


CODE_BACKENDS = (Backend("numpy", NumpyPrinter), Backend("torch", TorchPrinter))
LATEX = Backend("latex", LatexPrinter, "document.tex.jinja", ".tex", "%")
BACKENDS = (*CODE_BACKENDS, LATEX)
