"""The runtime's text for a generated module: the files of ``runtime/`` a module holds (its
backend's array primitives, the common files, and the optional ones its dimensions call
for), each copied as it is below its stand-in imports, its docstring as a comment above it.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from ..runtime.loading import body
from .resources import RUNTIME

#: The files every module holds after its groups, in order.
COMMON = ("arguments.py", "namespace.py", "contract.py", "saved.py")

#: The files a module holds only when its constant dimensions include one of the names given.
OPTIONAL = (
    ("rotary.py", ("n_2", "n_r")),
    ("relative.py", ("n_u",)),
    ("pooling.py", ("n_1",)),
)

_RULE = "# " + "-" * 87


def arrays(backend: str) -> str:
    """The file of ``backend``'s array primitives."""
    return f"{backend}_arrays.py"


def sources(backend: str) -> tuple[str, ...]:
    """Every runtime file that can shape a module of ``backend`` (for its source hash): those
    it may hold, and ``loading.py``, which cuts their stand-ins off."""
    return (arrays(backend), *COMMON, *(name for name, _ in OPTIONAL), "loading.py")


def after_arrays(constant_dims: Mapping[str, int]) -> list[str]:
    """The runtime files a module with ``constant_dims`` holds after its groups, in order."""
    return [*COMMON, *(name for name, dims in OPTIONAL
                       if any(d in constant_dims for d in dims))]


def public(name: str) -> list[str]:
    """The public functions of ``runtime/name`` (a module's API), in the file's order."""
    tree = ast.parse((RUNTIME / name).read_text(encoding="utf-8"))
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def api_text(width: int = 90) -> list[str]:
    """The lines of a module docstring's "Public API" paragraph (every public function of
    ``contract.py``, then those of ``saved.py`` for chaining modules)."""
    quoted = ", ".join(f"``{name}``" for name in ["PARAMS", "STRUCTURED", *public("contract.py")])
    chaining = ", ".join(f"``{name}``" for name in public("saved.py"))
    text = (f"Public API: {quoted}; for chaining modules (one forward pass kept, as autograd "
            f"keeps it): {chaining}.")
    return textwrap.wrap(text, width)


def section(name: str) -> str:
    """``runtime/name`` as a module holds it: a banner with its docstring, then its code."""
    text = (RUNTIME / name).read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text)) or ""
    comment = "\n".join(f"# {line}".rstrip() for line in doc.splitlines())
    return f"{_RULE}\n# runtime/{name}, copied:\n#\n{comment}\n{_RULE}\n\n{body(name)}"


def text(names: list[str]) -> str:
    """The sections of the runtime files ``names``, one after another."""
    return "\n\n".join(section(name) for name in names)
