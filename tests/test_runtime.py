"""The runtime (``runtime/``, ``curvgap.runtime``): written once as plain Python and copied
into every generated module, which stays standalone; its text is part of each module's
source hash (so of the module cache's key too)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
from conftest import SHIPPED

from curvgap.codegen import runtime
from curvgap.codegen.backends import MODULE_BACKENDS
from curvgap.codegen.generate import hashed_sources, source_hash
from curvgap.codegen.module import constant_dims
from curvgap.codegen.resources import GENERATED, RUNTIME
from curvgap.runtime import loading
from curvgap.runtime.loading import body

#: the files copied into modules (``loading.py`` is how the toolkit reads them)
COPIED = sorted(p.name for p in RUNTIME.glob("*.py")
                if not p.name.startswith("_") and p.name != "loading.py")


def _below_stand_ins(name: str) -> str:
    """The text of ``runtime/name`` below its stand-in block, read here on its own."""
    text = (RUNTIME / name).read_text()
    marker = "# -- end stand-ins --\n"
    assert text.count(marker) == 1, name
    return text.split(marker)[1].lstrip("\n")


def test_every_runtime_file_is_copied_by_some_module():
    copied = {name for b in MODULE_BACKENDS for name in runtime.sources(b.name)}
    assert copied == {*COPIED, "loading.py"}
    assert {"arguments.py", "contract.py", "saved.py", "rotary.py"} <= copied


@pytest.mark.parametrize("name", COPIED)
def test_each_runtime_file_imports_as_plain_python(name):
    """The stand-ins resolve: each file is a module of the package (names it reads from the
    generated module are stubs of ``_module_names.py``, or the other runtime files')."""
    module = importlib.import_module(f"curvgap.runtime.{name.removesuffix('.py')}")
    assert module.__doc__
    assert body(name) == _below_stand_ins(name)


def test_the_backends_arrays_have_the_same_names():
    """What the other runtime files read from ``numpy_arrays.py`` (standing in for the
    backend's) every backend's primitives define."""
    def defined(name):
        tree = ast.parse((RUNTIME / name).read_text())
        return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}

    read = set()
    for name in COPIED:
        for node in ast.parse((RUNTIME / name).read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module == "numpy_arrays":
                read |= {alias.name for alias in node.names}
    assert len(read) > 10
    for b in MODULE_BACKENDS:
        assert read <= defined(runtime.arrays(b.name)), b.name


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*/*.py")), ids=lambda p: p.as_posix())
def test_a_generated_module_holds_the_runtime_and_imports_only_its_libraries(path):
    if path.name == "__init__.py":
        return
    text = path.read_text()
    dims = constant_dims(SHIPPED[path.stem])
    for name in [runtime.arrays(path.parent.name), *runtime.after_arrays(dims)]:
        assert _below_stand_ins(name) in text, name
        assert f"# runtime/{name}, copied:" in text
    left_out = set(COPIED) - {runtime.arrays(path.parent.name), *runtime.after_arrays(dims)}
    for name in left_out:
        assert f"# runtime/{name}" not in text
    assert "stand-ins" not in text and "_module_names" not in text
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported == {"math", path.parent.name}, imported


def test_optional_runtime_files_follow_the_dimensions():
    assert runtime.after_arrays({}) == list(runtime.COMMON)
    assert runtime.after_arrays({"h": 2, "n_r": 4})[-1] == "rotary.py"
    assert runtime.after_arrays({"n_2": 2, "n_u": 8, "n_1": 1})[-3:] == [
        "rotary.py", "relative.py", "pooling.py"]


def test_a_change_to_the_runtime_changes_the_source_hash(monkeypatch):
    """A module's source hash (its header, and the module cache's check of a cached file)
    covers the runtime files it copies, and only its own backend's primitives."""
    config = SHIPPED["layernorm"]
    for b in MODULE_BACKENDS:
        hashed = set(hashed_sources(b))
        assert {RUNTIME / name for name in runtime.sources(b.name)} <= hashed
        others = {runtime.arrays(o.name) for o in MODULE_BACKENDS if o is not b}
        assert not {RUNTIME / name for name in others} & hashed
    before = {b.name: source_hash(config, b) for b in MODULE_BACKENDS}
    read = pathlib.Path.read_bytes

    def edited(path):
        data = read(path)
        return data + b"# edited\n" if path == RUNTIME / "saved.py" else data

    monkeypatch.setattr(pathlib.Path, "read_bytes", edited)
    assert all(source_hash(config, b) != before[b.name] for b in MODULE_BACKENDS)


def test_a_runtime_file_without_its_stand_in_block_is_refused(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text('"""Doc."""\n\nimport math\n')
    monkeypatch.setattr(loading, "HERE", tmp_path)
    with pytest.raises(loading.RuntimeFileError, match="runtime/bad.py: expected a block"):
        loading.body("bad.py")
    (tmp_path / "bad.py").write_text(f'"""Doc."""\n\n{loading.STAND_INS}\nx = 1\n'
                                     f'{loading.END_STAND_INS}\n')
    with pytest.raises(loading.RuntimeFileError, match="only imports"):
        loading.body("bad.py")
