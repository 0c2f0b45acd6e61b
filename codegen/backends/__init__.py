"""The backends, one package each (printer, config, and its folder under ``templates/``).

To add one: a package here whose ``BACKEND`` is a :class:`~.backend.Backend`, its templates
folder, and its line below. Generation, verification, the tests and the benchmarks walk
:data:`BACKENDS`.
"""

from . import latex, numpy, torch
from .backend import Backend

BACKENDS: tuple[Backend, ...] = (
    numpy.BACKEND,
    torch.BACKEND,
    latex.BACKEND,
)

#: The backends whose files are modules of the generated-module contract.
MODULE_BACKENDS = tuple(b for b in BACKENDS if b.writes_modules)


def backend(name: str) -> Backend:
    """The backend called ``name``."""
    for candidate in BACKENDS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no backend {name!r}; the backends are "
                   + ", ".join(b.name for b in BACKENDS))


__all__ = ["BACKENDS", "MODULE_BACKENDS", "Backend", "backend"]
