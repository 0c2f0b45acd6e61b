"""The runtime's code as the toolkit runs it: a file's text below its stand-in imports (what
the generator copies into every generated module), and the argument checks bound to one
backend's array primitives (what a chain of modules and a traced module call, so that their
checks of ``wrt``, ``v``, ``out=`` and overflow are the generated modules' own)."""

from __future__ import annotations

import ast
import functools
import importlib
import types
from pathlib import Path

#: the folder of the runtime's files
HERE = Path(__file__).resolve().parent

#: The stand-in block of a runtime file: imports of what the generated module defines.
STAND_INS = "# -- stand-ins: the generated module defines these (not copied) --"
END_STAND_INS = "# -- end stand-ins --"


class RuntimeFileError(ValueError):
    """A runtime file is not laid out as the generator copies it."""


def body(name: str) -> str:
    """The text of ``runtime/name`` below its stand-in block (checked: a docstring above
    it, only imports in it)."""
    text = (HERE / name).read_text(encoding="utf-8")
    head, found, rest = text.partition(STAND_INS + "\n")
    block, ended, code = rest.partition(END_STAND_INS + "\n")
    if not found or not ended:
        raise RuntimeFileError(f"runtime/{name}: expected a block between {STAND_INS!r} and "
                               f"{END_STAND_INS!r} after the docstring")
    module = ast.parse(head)
    if not (len(module.body) == 1 and ast.get_docstring(module)):
        raise RuntimeFileError(f"runtime/{name}: expected only a docstring above the stand-ins")
    if not all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in ast.parse(block).body):
        raise RuntimeFileError(f"runtime/{name}: expected only imports among the stand-ins")
    return code.lstrip("\n")


@functools.cache
def checks(backend: str) -> types.ModuleType:
    """``arguments.py`` run over ``backend``'s primitives (``"torch"`` or ``"numpy"``): its
    checks as a generated module of that backend holds them."""
    if backend not in ("torch", "numpy"):
        raise ValueError(f"backend: expected 'torch' or 'numpy', got {backend!r}")
    arrays = importlib.import_module(f"{__package__}.{backend}_arrays")
    text = (HERE / "arguments.py").read_text(encoding="utf-8")
    module = types.ModuleType(f"{__package__}.arguments[{backend}]",
                              ast.get_docstring(ast.parse(text)))
    module.__dict__.update({k: v for k, v in vars(arrays).items() if not k.startswith("__")})
    code = body("arguments.py")
    above = text[:text.index(code)].count("\n")  # tracebacks name the file's own lines
    exec(compile("\n" * above + code, str(HERE / "arguments.py"), "exec"), module.__dict__)
    return module
