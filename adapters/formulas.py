"""A module's formulas as a LaTeX document, written in the module's own names: its
parameters, its sizes (from its integer attributes and its config's) and what its
intermediates compute (:mod:`curvgap.codegen.backends.latex.names`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..codegen.backends.latex import document
from ..codegen.backends.latex.pdf import compile_pdf
from ..derivations.program import Program


def size_attributes(module: torch.nn.Module) -> dict[str, int]:
    """The integer attributes of ``module``, its submodules and their ``config`` objects
    (name → value; the first met wins): what names the sizes of its formulas."""
    found: dict[str, int] = {}
    for sub in module.modules():
        holders = [vars(sub)]
        config = getattr(sub, "config", None)
        if config is not None and not isinstance(config, torch.nn.Module):
            holders.append(getattr(config, "__dict__", {}))
        for holder in holders:
            for name, value in holder.items():
                if type(value) is int and value > 1 and not name.startswith("_"):
                    found.setdefault(name, value)
    return found


def module_document(module: torch.nn.Module, program: Program, title: str,
                    names: Mapping[str, str | int] | None, pdf: str | Path | None) -> str:
    """The document of ``program`` (a part of ``module``, titled ``title``), in the module's
    names and the caller's ``names``; compiled into ``pdf`` when given."""
    if names is not None and not isinstance(names, Mapping):
        raise ValueError(f"names: expected a dict of symbols, got {type(names).__name__}")
    program = dataclasses.replace(program, name=re.sub(r"\W", "_", title), title=title,
                                  scope="all")  # with the output Hessians the blocks cite
    text = document(program, attributes=size_attributes(module), names=dict(names or {}))
    if pdf is not None:
        compile_pdf(text, Path(pdf))
    return text
