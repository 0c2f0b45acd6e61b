"""What changes in the formulas from one block to another (:func:`formula_diff`): the two
blocks' documents, each in its own names, compared by
:mod:`curvgap.codegen.backends.latex.diff`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..codegen.backends.latex import BACKEND
from ..codegen.backends.latex.diff import COLUMN, diff_context, diff_document
from ..codegen.backends.latex.document import document_context
from ..codegen.backends.latex.markdown import diff_statements
from ..codegen.backends.latex.pdf import compile_pdf
from ..codegen.backends.latex.printer import tex_text
from ..codegen.resources import shipped_configs
from ..derivations.config import Config, load
from ..derivations.derivation import derive
from .curvature import Curvature
from .formulas import program_of, size_attributes, titled


def formula_diff(a: Any, b: Any, X: torch.Tensor | None = None,
                 labels: tuple[str, str] | None = None, pdf: str | Path | None = None,
                 markdown: bool = False, **inputs: Any) -> str:
    """What changes in the formulas from the block ``a`` to the block ``b``, as a LaTeX
    document (Markdown for a web page with ``markdown=True``; compiled into ``pdf`` when
    given): each loss-Hessian block new, gone, changed (naming the derivatives it reads that
    changed: :math:`J_V`, :math:`J_W`, :math:`\\partial^2 Z / \\partial V \\partial W`) or
    the same; the symbols new or gone; the two architectures side by side; the chain of each
    first derivative that changed, side by side.

    ``a`` and ``b`` are modules (``torch.nn.Module`` or :func:`curvgap.curvature` objects,
    read on the input ``X`` with the keyword ``inputs``; for a model, its first block) or
    configs (:class:`~curvgap.derivations.config.Config`, a shipped config's name or a TOML
    file). ``labels`` head the two columns (default the two titles)."""
    if labels is not None and not (isinstance(labels, tuple | list) and len(labels) == 2
                                   and all(isinstance(x, str) for x in labels)):
        raise ValueError(f"labels: expected two strings, got {labels!r}")
    sources = [_source(which, source, X) for which, source in (("a", a), ("b", b))]
    contexts, titles = zip(*(_context(source, X, inputs) for source in sources), strict=True)
    if labels is None:
        labels = titles if titles[0] != titles[1] else (f"{titles[0]} (a)", f"{titles[1]} (b)")
    if markdown:
        return diff_statements(diff_context(*contexts, tuple(labels)))
    text = diff_document(*contexts, tuple(tex_text(x) for x in labels))
    if pdf is not None:
        compile_pdf(text, Path(pdf))
    return text


def _source(which: str, source: Any, X: torch.Tensor | None) -> Any:
    """The block ``source`` (argument ``which``) as a config or a module's curvature; its
    input checked."""
    if isinstance(source, str | Path):  # a shipped config's name, else a config file
        shipped = {path.stem: path for path in shipped_configs()}
        path = shipped.get(str(source), Path(source))
        if not path.is_file():
            raise ValueError(f"{which}: expected a shipped config name ({', '.join(shipped)}) "
                             f"or a config file, got {str(source)!r}")
        return load(path)
    if isinstance(source, Config):
        return source
    if isinstance(source, torch.nn.Module):
        source = Curvature(source)
    if not isinstance(source, Curvature):
        raise ValueError(f"{which}: expected a torch.nn.Module, a curvgap.curvature object, a "
                         f"Config or a config's name, got {type(source).__name__}")
    if not isinstance(X, torch.Tensor):
        raise ValueError(f"X: a module's formulas need its input, a tensor, got "
                         f"{type(X).__name__}")
    return source


def _context(source: Any, X: torch.Tensor | None, inputs: dict[str, Any]) -> tuple[dict, str]:
    """The document context of the block ``source`` (a config or a module's curvature)
    printed for a column of the diff, and its title."""
    if isinstance(source, Config):
        return document_context(derive(source), BACKEND, line=COLUMN), source.name
    module, program, title = program_of(source, X, None, inputs)
    der = derive(titled(program, title))
    context = document_context(der, BACKEND, attributes=size_attributes(module), line=COLUMN)
    return context, title
