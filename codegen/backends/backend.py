"""What a backend is, in the manner of SymForce's codegen backends: a printer, a small
config (what it writes, where, how the reference reaches it) and its templates folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
from sympy.printing.printer import Printer

from ...derivations.derivation import Derivation
from ..resources import TEMPLATES


@dataclass(frozen=True)
class Backend:
    """One output of a derivation: ``generated/<name>/<config><suffix>``.

    ``context(der, backend)`` gives the variables of the template ``template``, looked up in
    the folders ``templates/<folder>`` for ``folder`` in ``templates`` (first wins);
    ``delimiters`` are Jinja's (LaTeX needs other braces). ``sources`` are the codegen files
    and folders, relative to ``codegen/``, that shape the output: with the engine, the
    templates and the files ``runtime`` of ``runtime/`` that its modules copy
    (:mod:`~curvgap.codegen.runtime`) they make up its source hash. ``array_module`` is the
    library its code calls
    (imported under the printer's ``module`` name). ``from_torch`` converts the verifier's float64
    torch tensors to this backend's arrays; it is None for a backend whose files are not
    modules to run (the document).
    """

    name: str
    printer: type[Printer]
    context: Callable[[Derivation, Backend], dict[str, Any]]
    template: str
    templates: tuple[str, ...]
    sources: tuple[str, ...]
    runtime: tuple[str, ...] = ()
    suffix: str = ".py"
    comment: str = "#"          # starts each line of the generated file's header
    delimiters: dict[str, str] = field(default_factory=dict)
    array_module: str | None = None
    from_torch: Callable[[Any], Any] | None = None

    @property
    def writes_modules(self) -> bool:
        """Whether its files are modules of the generated-module contract (verified)."""
        return self.from_torch is not None

    def render(self, der: Derivation, **options: Any) -> str:
        """The body of ``der``'s file (below the header); ``options`` go to ``context``."""
        return self.render_template(self.template, self.context(der, self, **options))

    def render_template(self, template: str, context: dict[str, Any]) -> str:
        """The template ``template`` of this backend's folders filled in with ``context``."""
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([TEMPLATES / f for f in self.templates]),
            keep_trailing_newline=True, undefined=jinja2.StrictUndefined, autoescape=False,
            **self.delimiters)
        return env.get_template(template).render(**context).lstrip("\n")
