"""Backends in the manner of SymForce's: a printer, a small config, a templates folder."""

from __future__ import annotations

from dataclasses import dataclass

from .printers import ArrayPrinter, NumpyPrinter, TorchPrinter


@dataclass(frozen=True)
class Backend:
    name: str                   # also the folder under templates/ and generated/
    printer: type[ArrayPrinter]
    template: str = "module.py.jinja"
    suffix: str = ".py"


BACKENDS = (Backend("numpy", NumpyPrinter), Backend("torch", TorchPrinter))
