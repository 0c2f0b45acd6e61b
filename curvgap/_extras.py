"""Optional packages: a feature that needs one imports it through :func:`require` (or asks
:func:`missing` before any work), and a package that is not installed is one line naming the
feature, the package and the ``pip install`` that adds it."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from types import ModuleType

#: The name pip knows an import by, where the two differ.
DISTRIBUTIONS = {"sklearn": "scikit-learn", "curvlinops": "curvlinops-for-pytorch"}
#: Packages that no extra of curvgap installs, and how to install them: curvlinops without its
#: dependencies (its backpack dependency pulls torchvision, which would replace the pinned
#: torch), JAX on the CPU.
APART = {"curvlinops": "pip install --no-deps curvlinops-for-pytorch einops einconv "
                       "linear_operator",
         "jax": 'pip install "jax[cpu]"'}


class MissingExtra(ImportError):
    """An optional package a feature needs is not installed; the message says what to
    install."""


def message(modules: Iterable[str], feature: str, extra: str | None = None) -> str:
    """``"<feature> needs <packages>: <pip install ...>"``: the ``extra`` of curvgap that
    adds ``modules`` (top-level import names), or the command of :data:`APART`."""
    modules = list(modules)
    names = ", ".join(DISTRIBUTIONS.get(m, m) for m in modules)
    if extra is not None:
        install = f'pip install "curvgap[{extra}]"'
    else:
        install = " && ".join(APART[m] for m in modules)
    return f"{feature} needs {names}: {install}"


def missing(modules: Iterable[str], feature: str, extra: str | None = None) -> str | None:
    """The :func:`message` for those of ``modules`` that are not installed (None when all
    are), found without importing them."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return message(absent, feature, extra) if absent else None


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """``module`` (a dotted name), imported; :class:`MissingExtra` with the one-line
    :func:`message` when its package is not installed (an installed package that fails to
    import raises its own error)."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if (error.name or "").partition(".")[0] != top or importlib.util.find_spec(top):
            raise
        raise MissingExtra(message([top], feature, extra), name=top) from None
