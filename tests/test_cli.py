"""The command line answers at once: ``--help`` and a bad path argument stop before torch or
SymPy is imported, and the verification table of ``curvgap generate`` names each module
before its checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import SHIPPED

from curvgap.cli import verification
from curvgap.codegen.resources import GENERATED

#: ``python -m curvgap.cli ARGS``, then the exit status and which heavy modules it imported.
PROBE = """
import runpy, sys
sys.argv = ["curvgap", *sys.argv[1:]]
try:
    runpy.run_module("curvgap.cli", run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(code, [m for m in ("torch", "sympy") if m in sys.modules])
"""


def probe(*args: str, cwd=None) -> tuple[str, str]:
    """The last line ``python -m curvgap.cli ARGS`` prints (status and heavy imports), and
    its stderr."""
    run = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         timeout=120, cwd=cwd)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()[-1], run.stderr


@pytest.mark.parametrize("command", ["", "generate", "latex", "bench", "reproduce"])
def test_help_imports_neither_torch_nor_sympy(command):
    last, _ = probe(*command.split(), "--help")
    assert last == "0 []"


@pytest.mark.parametrize("args, message", [
    (["generate", "--out", "afile.txt/sub"], "--out: expected a folder path, got "
                                              "'afile.txt/sub', but 'afile.txt' is a file"),
    (["generate", "--config", "gone.toml"], "--config: expected a TOML file, got 'gone.toml', "
                                            "which does not exist"),
    (["generate", "--check", "--config", "."], "--config: expected a TOML file, got the "
                                               "folder '.'"),
    (["latex", "gone.toml"], "NAME: expected a shipped config name or a .toml file, got "
                             "'gone.toml', which does not exist"),
    (["latex", "ffn", "--out", "afile.txt"], "--out: expected a folder, got 'afile.txt', "
                                             "which is a file"),
    (["bench", "--out", "afile.txt/sub"], "--out: expected a folder path"),
    (["bench", "--scale", "--config", "gone"], "--config: expected a shipped config name"),
    (["reproduce", "--out", "afile.txt/sub"], "--out: expected a folder path"),
    (["bench", "--device", "cuda"], "--device cuda: expected --models with it"),
    (["bench", "--fused"], "--fused: expected --models or --scale with it"),
])
def test_a_bad_path_stops_before_torch_and_sympy_are_imported(args, message, tmp_path):
    (tmp_path / "afile.txt").write_text("mine")
    last, err = probe(*args, cwd=tmp_path)
    assert last == "2 []"
    assert err.startswith(f"curvgap: error: {message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt"]


def test_verification_names_each_module_before_its_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CURVGAP_CACHE", str(tmp_path))  # nothing verified before
    before_checks = []
    real = verification.check_module

    def check_module(*args):
        before_checks.append(capsys.readouterr().out.splitlines()[-1])
        return real(*args)
    monkeypatch.setattr(verification, "check_module", check_module)
    paths = [GENERATED / backend / "layernorm.py" for backend in ("numpy", "torch")]
    assert verification.verify(paths, {"layernorm": SHIPPED["layernorm"]})
    assert before_checks == ["  [1/2] layernorm (numpy): checking ...",
                             "  [2/2] layernorm (torch): checking ..."]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  [2/2] layernorm (torch): ")
    assert "checks, max rel. error" in lines[0]
    table = lines[lines.index("  module                backend   checks   max rel. error  "
                              "worst"):]
    assert [row.split()[:2] for row in table[1:]] == [["layernorm", "numpy"],
                                                      ["layernorm", "torch"]]
    # verified before: named, not checked, and the table again
    assert verification.verify(paths, {"layernorm": SHIPPED["layernorm"]})
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["  [1/2] layernorm (numpy): verified before",
                          "  [2/2] layernorm (torch): verified before"]
    assert all(row.endswith("(verified before)") for row in lines[-2:])
    assert len(before_checks) == 2
