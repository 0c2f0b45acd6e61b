"""Shared fixtures: the shipped configs and their generated modules, every module backend."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from curvgap.codegen.backends import MODULE_BACKENDS
from curvgap.codegen.backends import backend as backend_named
from curvgap.codegen.resources import shipped_configs
from curvgap.derivations.config import load

BACKENDS = tuple(b.name for b in MODULE_BACKENDS)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # workers share the cores, torch's threads too
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True, scope="session")
def _verification_cache(tmp_path_factory):
    """The module cache (and the CLI's record of verified modules), kept out of the user's
    home during the tests: one folder for the run, shared by pytest-xdist's workers (the
    cache is made for processes sharing it), or ``$CURVGAP_TEST_CACHE`` where it is set (CI's
    quick and slow runs share one). Tests that need an empty cache make their own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = Path(os.environ.get("CURVGAP_TEST_CACHE") or root / "cache")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["CURVGAP_CACHE"] = str(folder)
SHIPPED = {path.stem: load(path) for path in shipped_configs()}


def generated_module(name: str, backend: str):
    return importlib.import_module(f"curvgap.generated.{backend}.{name}")


def to_backend(backend: str, value):
    """A float64 torch tensor as the backend's array type."""
    if isinstance(value, dict):
        return {k: to_backend(backend, v) for k, v in value.items()}
    return backend_named(backend).from_torch(value)


def as_numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def commutation(m: int, n: int) -> np.ndarray:
    """K_{m,n}: K vec(A) = vec(A^T) for A of shape m×n (vec column-major)."""
    K = np.zeros((m * n, m * n))
    for i in range(m):
        for j in range(n):
            K[i * n + j, j * m + i] = 1.0
    return K


def extra_module(module: str):
    """``module`` from the test extra; skipped with the reason when it is not installed,
    except under ``CURVGAP_REQUIRE_EXTRAS=1`` (CI), where its absence fails."""
    if os.environ.get("CURVGAP_REQUIRE_EXTRAS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"needs {module} (pip install -e '.[test]')")


class _Inert(type):
    """A class whose every attribute is another inert class."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``torchvision`` and its submodules give inert modules."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        # a version that parses (below any real release): libraries that ask, such as
        # transformers' image-processing imports, then take their paths without torchvision
        module.__version__ = "0.0"
        return module

    def exec_module(self, module):
        pass


def import_timm():
    """timm, from the test extra (installed with ``--no-deps``). timm imports torchvision
    when it is imported (for its image transforms and batch-norm freezing), and no
    torchvision wheel runs beside the pinned CPU torch (the registry's are CUDA builds);
    where torchvision fails to import, it is replaced by an inert stand-in. The layers
    tested here (the ViT ``Block``, ``Attention``, ``Mlp``) never touch it."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.meta_path.insert(0, _InertTorchvision())
    return extra_module("timm")
