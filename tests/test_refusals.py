"""Bad input, as a careful user tries it: a one-line message naming the argument, what was
expected and what was given (exit code 2 from the CLI, ValueError or TypeError from Python),
and the output folder byte-identical to before."""

from __future__ import annotations

import importlib.util
import os

import pytest
import sympy as sp
import torch
from conftest import SHIPPED, generated_module

from curvgap import cli
from curvgap.codegen.generate import generate
from curvgap.codegen.resources import CONFIGS, GENERATED
from curvgap.derivations import losses


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture
def out(tmp_path):
    """An output folder holding the modules of one small config."""
    folder = tmp_path / "out"
    generate([CONFIGS / "layernorm.toml"], folder, report=lambda line: None)
    return folder


def _refused(capsys, args: list[str], *expected: str) -> str:
    code = cli.main(["generate", "--no-verify", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("curvgap: error: "), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


CONFIG_FILES = {
    "a folder": (lambda tmp: tmp, "expected a TOML file, got the folder"),
    "a binary file": (lambda tmp: _file(tmp, b"\x89PNG\r\n\x1a\n\x00\xff"),
                      "expected UTF-8 text (TOML is UTF-8), got byte 0x89 at position 0"),
    "a Latin-1 file": (lambda tmp: _file(tmp, 'name = "caf\xe9"\n'.encode("latin-1")),
                       "got byte 0xe9 at position 11"),
    "an endless file": (lambda tmp: "/dev/zero", "expected a config of at most 1048576 bytes"),
    "a missing file": (lambda tmp: tmp / "nope.toml",
                       "--config: expected a TOML file, got '{tmp}/nope.toml', which does not exist"),
    "not TOML": (lambda tmp: _file(tmp, b"name = \n"), "not valid TOML"),
}


def _file(folder, data: bytes):
    path = folder / "config.toml"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", CONFIG_FILES)
def test_bad_config_files(case, tmp_path, out, capsys):
    make, message = CONFIG_FILES[case]
    before = snapshot(out)
    _refused(capsys, ["--config", str(make(tmp_path)), "--out", str(out)],
             message.format(tmp=tmp_path))
    assert snapshot(out) == before


NAMES = {
    "__init__": "must not start with '__' (names such as __init__ are Python's own",
    "torch": "must not be 'torch': a generated module of that name would shadow",
    "numpy": "must not be 'numpy'",
    "math": "must not be 'math'",
    "latex": "must not be 'latex'",
    "x" * 10_000: "'name' must have at most 64 characters (it names files), got 10000",
    "9lives": "'name' must be a Python identifier",
}


@pytest.mark.parametrize("name", NAMES, ids=lambda n: n[:12])
def test_names_that_would_replace_or_shadow_files(name, tmp_path, out, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f'name = "{name}"\nkind = "layernorm"\n')
    before = snapshot(out)
    _refused(capsys, ["--config", str(config), "--out", str(out)], NAMES[name])
    assert snapshot(out) == before


def test_a_user_config_does_not_replace_a_shipped_module(tmp_path, capsys):
    config = tmp_path / "mine.toml"
    config.write_text('name = "paper_block"\neps = 1e-3\n')
    before = snapshot(GENERATED)
    _refused(capsys, ["--config", str(config)],
             "'name' 'paper_block' is a shipped config's", "rename it or pass --out")
    assert snapshot(GENERATED) == before
    # the shipped config itself is fine (nothing changes)
    assert cli.main(["generate", "--no-verify", "--config", str(CONFIGS / "ffn.toml")]) == 0
    assert snapshot(GENERATED) == before


def test_bad_output_folders(tmp_path, out, capsys):
    before = snapshot(out)
    config = ["--config", str(CONFIGS / "layernorm.toml")]
    _refused(capsys, [*config, "--out", ""], "--out: expected a folder path, got an empty string")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    _refused(capsys, [*config, "--out", str(afile)], "which is a file")
    assert afile.read_text() == "mine"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    _refused(capsys, [*config, "--out", str(link)], "a symbolic link to the missing")
    assert not (tmp_path / "gone").exists()
    (out / "notes.txt").write_text("mine")  # refused when there is something to write
    _refused(capsys, ["--config", str(CONFIGS / "ffn.toml"), "--out", str(out)],
             "holds 'notes.txt', which curvgap did not write")
    assert snapshot(out) == {**before, "notes.txt": b"mine"}


@pytest.mark.parametrize("where, make", [
    ("torch", lambda folder: _replace(folder / "torch", "file")),
    ("numpy/layernorm.py", lambda folder: _replace(folder / "numpy" / "layernorm.py", "folder")),
    ("latex/layernorm.tex", lambda folder: _replace(folder / "latex" / "layernorm.tex", "link")),
])
def test_a_path_of_the_output_that_is_not_what_curvgap_wrote(where, make, out, capsys):
    make(out)  # which also leaves a file to write
    before = snapshot(out)
    _refused(capsys, ["--config", str(CONFIGS / "layernorm.toml"), "--out", str(out), "--force"],
             f"holds '{where}', which curvgap did not write")
    assert snapshot(out) == before


def _replace(path, kind: str) -> None:
    if path.is_dir():
        for item in path.iterdir():
            item.unlink()
        path.rmdir()
    else:
        path.unlink()
    if kind == "file":
        path.write_text("mine")
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(path.parent / "elsewhere.tex")


@pytest.mark.parametrize("command, package, extra", [
    ("bench", "matplotlib", "bench"), ("reproduce", "scipy", "analysis"),
    ("bench --models", "transformers", "transformers"),
    ("bench --distributed", "scikit-learn", "analysis")])
def test_a_missing_extra_says_what_to_install(command, package, extra, monkeypatch, capsys):
    """Before any work (the --out given is not a folder: it is never reached)."""
    real = importlib.util.find_spec
    module = "sklearn" if package == "scikit-learn" else package
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    assert cli.main([*command.split(), "--quick", "--out", os.devnull]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f'curvgap: error: curvgap {command} needs {package}: pip install '
                   f'"curvgap[{extra}]"')


# -- the generated modules -----------------------------------------------------------------

@pytest.mark.parametrize("shape, message", [
    ((0, 3, 4), "X: expected at least one sample of nonzero sizes (B, L, d), got shape (0, 3, 4)"),
    ((2, 0, 4), "X: expected at least one sample of nonzero sizes (B, L, d), got shape (2, 0, 4)"),
])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_empty_inputs(shape, message, backend):
    module = generated_module("layernorm_affine", backend)
    X = torch.zeros(shape, dtype=torch.float64)
    params = {"gamma": torch.ones(4, dtype=torch.float64), "beta": torch.zeros(4, dtype=torch.float64)}
    if backend == "numpy":
        X, params = X.numpy(), {k: v.numpy() for k, v in params.items()}
    with pytest.raises(ValueError) as error:
        module.forward(params, X)
    assert str(error.value) == message


def test_meta_tensors_are_refused():
    module = generated_module("layernorm", "torch")
    with pytest.raises(ValueError, match="X: expected a tensor with values, got one on the meta"):
        module.forward({}, torch.empty(2, 3, 4, device="meta", dtype=torch.float64))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_wrt_of_the_wrong_type(backend):
    module = generated_module("layernorm_affine", backend)
    X = torch.randn(2, 3, 4, dtype=torch.float64)
    params = {"gamma": torch.ones(4, dtype=torch.float64), "beta": torch.zeros(4, dtype=torch.float64)}
    if backend == "numpy":
        X, params = X.numpy(), {k: v.numpy() for k, v in params.items()}
    with pytest.raises(TypeError, match=r"wrt: expected 'X', a parameter name or a list of "
                                        r"names, got an int"):
        module.loss_hessian(params, X, X, wrt=5)
    with pytest.raises(ValueError, match="wrt: expected 'X' or one of the parameters"):
        module.jacobian(params, X, 5)


# -- registered losses ---------------------------------------------------------------------

r = losses.r
LOSSES = {
    "huber": (sp.Piecewise((r**2 / 2, sp.Abs(r) <= 1), (sp.Abs(r) - sp.Rational(1, 2), True)),
              ValueError, "uses Piecewise, which the generated code does not print"),
    "constant": (sp.Integer(3), ValueError, "got the constant 3 (its derivatives are all zero)"),
    "infinite": (sp.zoo * r, ValueError, "expected a finite loss, but its derivative of order 0"),
    "other_symbol": (sp.Symbol("s") * r, ValueError, "got free symbols ['s']"),
    "text": ("r**2", TypeError, "expr: expected a SymPy expression of r, got 'r**2' (str)"),
}


@pytest.mark.parametrize("name", LOSSES)
def test_registered_losses_are_checked_when_registered(name):
    expr, error, message = LOSSES[name]
    with pytest.raises(error) as raised:
        losses.register_residual_loss(f"bad_{name}", expr)
    assert message in str(raised.value)
    assert f"bad_{name}" not in losses.names()


def test_a_plain_symbol_r_is_the_residual():
    losses.register_residual_loss("plain_r_cosh", sp.log(sp.cosh(sp.Symbol("r"))))
    assert losses.residual_loss("plain_r_cosh").free_symbols == {r}


def test_every_printable_function_prints_in_every_backend():
    """The functions a registered loss may use are the ones the printers print."""
    from curvgap.codegen.backends import MODULE_BACKENDS
    from curvgap.derivations.functions import PRINTABLE

    u = sp.Symbol("u", real=True)
    for backend in MODULE_BACKENDS:
        printer = backend.printer()
        for function in PRINTABLE:
            expr = function(u, 0) if function is sp.Max else function(u)
            assert "u" in printer.doprint(expr), (backend.name, function)
    assert SHIPPED  # the shipped configs load (the fixture the modules above come from)


def test_the_python_api_raises_value_errors_for_bad_arguments(tmp_path, out):
    """The same refusals from Python: ValueError subclasses naming the argument."""
    from curvgap.derivations.config import ConfigError

    config = [CONFIGS / "ffn.toml"]
    with pytest.raises(ValueError, match="--out: expected a folder path"):
        generate(config, "", report=lambda line: None)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="which curvgap did not write"):
        generate(config, out, report=lambda line: None)
    with pytest.raises(ConfigError, match="expected a TOML file, got the folder"):
        generate([tmp_path], tmp_path / "elsewhere", report=lambda line: None)
    assert not (tmp_path / "elsewhere").exists()


def test_latex_refuses_a_file_as_its_folder(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert cli.main(["latex", "ffn", "--out", str(afile)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: --out: expected a folder, got {str(afile)!r}, which is a file")
    assert afile.read_text() == "mine"


SHIPPED_NAMES = ", ".join(sorted(SHIPPED))


@pytest.mark.parametrize("name, message", [
    ("no_such_config", f"NAME: expected a shipped config name ({SHIPPED_NAMES}) or a .toml "
                       "file, got 'no_such_config'"),
    ("{tmp}/gone.toml", "NAME: expected a shipped config name or a .toml file, got "
                        "'{tmp}/gone.toml', which does not exist"),
    ("{tmp}", "NAME: expected a shipped config name or a .toml file, got the folder '{tmp}'"),
])
def test_latex_name_that_is_no_config(name, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["latex", name.format(tmp=tmp_path), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"curvgap: error: {message.format(tmp=tmp_path)}"
    assert not out.exists()


def test_bench_config_names_a_shipped_config(capsys, tmp_path):
    assert cli.main(["bench", "--quick", "--config", "nope", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"curvgap: error: --config: expected a shipped config name ({SHIPPED_NAMES}), got "
        "'nope'")
    assert not list(tmp_path.iterdir())
