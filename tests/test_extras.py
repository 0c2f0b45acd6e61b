"""A missing optional package is one line naming the feature, the package and the
``pip install`` that adds it, wherever it is needed (the package hidden with
``sys.modules[name] = None``, as if it were not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from curvgap._extras import MissingExtra, message, require


def run_without(module: str, code: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh process in which ``module`` cannot be imported."""
    return subprocess.run([sys.executable, "-c", f"import sys\nsys.modules[{module!r}] = None\n"
                           + code], capture_output=True, text=True, timeout=300)


def test_to_scipy_without_scipy():
    run = run_without("scipy", "import torch\n"
                               "from curvgap.operators import CurvatureOperator\n"
                               "CurvatureOperator(lambda V: V, 3, torch.float64, 'cpu')"
                               ".to_scipy()\n")
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        'curvgap._extras.MissingExtra: to_scipy() needs scipy: pip install "curvgap[operators]"')
    assert run.stderr.count("Traceback") == 1  # the one line, not a chain of errors


@pytest.mark.parametrize("command, module, line", [
    ("bench --quick", "matplotlib", 'curvgap bench needs matplotlib: pip install "curvgap[bench]"'),
    ("bench --models --quick", "transformers",
     'curvgap bench --models needs transformers: pip install "curvgap[transformers]"'),
    ("bench --distributed --quick", "sklearn",
     'curvgap bench --distributed needs scikit-learn: pip install "curvgap[analysis]"'),
    ("reproduce --quick", "scipy", 'curvgap reproduce needs scipy: pip install "curvgap[analysis]"'),
])
def test_a_command_without_its_extra(command, module, line, tmp_path):
    run = run_without(module, "from curvgap.cli import main\n"
                              f"sys.exit(main({[*command.split(), '--out', str(tmp_path)]!r}))\n")
    assert run.returncode == 2
    assert run.stderr == f"curvgap: error: {line}\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("module, call, line", [
    ("transformers", "from curvgap.benchmarks.models import run_models\n"
                     "run_models(True, 'unused')\n",
     'curvgap bench --models needs transformers: pip install "curvgap[transformers]"'),
    ("jax", "from curvgap.benchmarks import jax_routes\n"
            "jax_routes.routes(None, {}, None, None, None)\n",
     'the JAX comparison needs jax: pip install "jax[cpu]"'),
])
def test_the_python_api_without_an_optional_package(module, call, line):
    run = run_without(module, call)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == f"curvgap._extras.MissingExtra: {line}"


def test_the_messages_name_the_pip_install():
    assert message(["curvlinops"], "the curvlinops comparison") == (
        "the curvlinops comparison needs curvlinops-for-pytorch: pip install --no-deps "
        "curvlinops-for-pytorch einops einconv linear_operator")
    assert message(["matplotlib", "sklearn"], "figures", "analysis") == (
        'figures needs matplotlib, scikit-learn: pip install "curvgap[analysis]"')


def test_require_converts_only_a_missing_package(tmp_path, monkeypatch):
    """An installed package that fails to import raises its own error."""
    (tmp_path / "broken_package").mkdir()
    (tmp_path / "broken_package" / "__init__.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as raised:
        require("broken_package", "a feature", "analysis")
    assert not isinstance(raised.value, MissingExtra)
    assert raised.value.name == "no_such_dependency"
    monkeypatch.setitem(sys.modules, "hidden_package", None)
    with pytest.raises(MissingExtra, match=r'^a feature needs hidden_package: pip install '
                                           r'"curvgap\[analysis\]"$'):
        require("hidden_package.sub", "a feature", "analysis")
