"""The house: imports run only downstream along the pipeline, and never in a circle.

The pipeline is ``runtime → configs → derivations → codegen → templates → generated``: a
package may import itself and the packages before it. ``runtime`` comes first: it is the code
copied into every generated module, imports nothing of the toolkit, and codegen reads its
files. The tools sit on top of it, in this order:
``data`` (means over datasets and ranks), ``operators`` (curvature as linear operators,
structured blocks), ``models`` (chains of generated modules), ``adapters`` (real layers),
``analysis``, ``benchmarks``, ``cli``; each may import the pipeline and the tools before it,
and nothing below them imports them. Every import counts, at module level or inside a
function.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ["runtime", "configs", "derivations", "codegen", "templates", "generated"]
ON_TOP = ["data", "operators", "models", "adapters", "analysis", "benchmarks", "cli"]


def _modules() -> dict[str, Path]:
    """``curvgap.<package>.<module>`` → its source file, for every package of the toolkit."""
    found = {}
    for package in PIPELINE + ON_TOP:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("curvgap", *parts))] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The toolkit modules that the module ``name`` imports, anywhere in its body."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    text = path.read_text(encoding="utf-8")
    if path.parts[-3:-2] == ("generated",) or path.parent.name == "generated":
        # a generated module imports at its top only (its 10,000s of lines need no parse)
        text = "\n".join(line for line in text.splitlines()
                         if line.startswith(("import ", "from ")))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "curvgap":
                out.add(target)
    return out


def _layer(module: str) -> str:
    return module.split(".")[1]


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_the_graph_sees_the_imports():
    graph = _graph()
    assert "curvgap.derivations.calculus" in graph["curvgap.derivations.softmax"]
    assert "curvgap.derivations.derivation" in graph["curvgap.codegen.lowering"]
    assert len(graph) > 30


def test_the_tools_import_only_those_before_them():
    upward = [f"{module} imports {target}" for module, imported in _graph().items()
              for target in imported
              if _layer(module) in ON_TOP and _layer(target) in ON_TOP
              and ON_TOP.index(_layer(target)) > ON_TOP.index(_layer(module))]
    assert not upward, "imports against the order of the tools:\n" + "\n".join(upward)


def test_imports_run_downstream():
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            a, b = _layer(module), _layer(target)
            if a in ON_TOP:
                continue
            if b in ON_TOP or PIPELINE.index(b) > PIPELINE.index(a):
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against the pipeline:\n" + "\n".join(sorted(upward))


def test_the_runtime_imports_nothing_of_the_toolkit():
    """``runtime/`` is copied into standalone modules: its files import one another (their
    stand-ins) and otherwise only the standard library, numpy and torch."""
    import sys

    graph = _graph()
    runtime = [name for name in graph if _layer(name) == "runtime"]
    assert "curvgap.runtime.contract" in runtime
    assert all(_layer(target) == "runtime" for name in runtime for target in graph[name])
    allowed = set(sys.stdlib_module_names) | {"numpy", "torch"}
    for path in (ROOT / "runtime").glob("*.py"):
        text = path.read_text(encoding="utf-8")
    if path.parts[-3:-2] == ("generated",) or path.parent.name == "generated":
        # a generated module imports at its top only (its 10,000s of lines need no parse)
        text = "\n".join(line for line in text.splitlines()
                         if line.startswith(("import ", "from ")))
    for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            assert {n.split(".")[0] for n in names} <= allowed, (path.name, names)


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(" → ".join(stack[stack.index(target):] + [node, target]
                                         if target in stack else [node, target]))
            elif target not in state:
                visit(target, [*stack, node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_nothing_shipped_cites_the_teams_notes():
    """Generated files, sources, docs and the README explain their conventions themselves: a
    user has no design notes of the team to look them up in."""
    citing = []
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT)
        if not path.is_file() or relative.parts[0].startswith(".") or path.suffix not in (
                ".py", ".jinja", ".md", ".tex", ".toml", ".txt"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "DESIGN" + ".md" in text or "PAPER" + "_NOTES" in text:
            citing.append(str(relative))
    assert not citing, f"files citing the team's notes: {citing}"
