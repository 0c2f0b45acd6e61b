"""A module's formulas as a LaTeX document, written in the module's own names: its
parameters, its sizes (from its integer attributes and its config's) and what its
intermediates compute (:mod:`curvgap.codegen.backends.latex.names`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..codegen.backends.latex import document
from ..codegen.backends.latex.markdown import statements
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
    text = document(titled(program, title), attributes=size_attributes(module),
                    names=dict(names or {}))
    if pdf is not None:
        compile_pdf(text, Path(pdf))
    return text


def program_of(c: Any, X: torch.Tensor, part: str | None, inputs: dict[str, Any]
               ) -> tuple[torch.nn.Module, Program, str]:
    """The submodule, program and title of ``part`` (default the first block, or the first
    part) of the module ``c`` (a :class:`~curvgap.adapters.curvature.Curvature`) read with
    these inputs."""
    _, _, traced, _ = c._prepared(X, None, inputs, needs_target=False)
    paths = traced.trace.paths
    if part is None:
        part = next((p for p in paths if p), paths[0])
    if part not in paths:
        raise ValueError(f"part: expected one of the module's parts {paths}, got {part!r}")
    try:
        module = c.module.get_submodule(part) if part else c.module
    except AttributeError:  # a part that is no one submodule (the layers before a block)
        module = c.module
    title = type(module).__name__ + (f" ({part})" if part else "")
    return module, traced.trace.programs[paths.index(part)], title


def module_statements(c: Any, X: torch.Tensor, heading: str = "###", **inputs: Any) -> str:
    """The statements of the module's document (symbols, architecture, loss-Hessian blocks)
    as Markdown with display math, for a web page (the module ``c`` a
    :class:`~curvgap.adapters.curvature.Curvature`)."""
    module, program, title = program_of(c, X, None, inputs)
    return statements(titled(program, title), heading, attributes=size_attributes(module))


def titled(program: Program, title: str) -> Program:
    """``program`` named for its document, with the output Hessians its blocks cite."""
    return dataclasses.replace(program, name=re.sub(r"\W", "_", title), title=title,
                               scope="all")
