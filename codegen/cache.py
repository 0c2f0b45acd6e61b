"""Generated modules of any config, made on first use into
``$CURVGAP_CACHE/modules`` (default ``~/.cache/curvgap/modules``), named by the hash of the
config's options (not its name), and reused while current."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

from ..derivations.config import Config
from ..derivations.program import Program
from .backends import MODULE_BACKENDS
from .backends import backend as backend_named
from .generate import recorded_state, relative_path, render_all, write

#: The modules loaded in this process, by path (a chain of N equal parts loads one).
_LOADED: dict[Path, ModuleType] = {}


def _cache() -> Path:
    root = os.environ.get("CURVGAP_CACHE") or Path.home() / ".cache" / "curvgap"
    return Path(root) / "modules"


def module_for(config: Config | Program, backend: str = "torch") -> ModuleType:
    """The generated ``backend`` module (``"torch"`` or ``"numpy"``) of ``config`` or of a
    program read from a module (generated once into the cache, named by the hash of what it
    computes, its options but its name, then reused; loaded once per process)."""
    if isinstance(config, Program):
        digest = config.fingerprint[:16]
    else:
        options = {**dataclasses.asdict(config), "name": ""}
        digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    config = dataclasses.replace(config, name=f"layer_{digest}")
    folder, chosen = _cache(), backend_named(backend)
    path = folder / relative_path(config, chosen)
    if path in _LOADED:
        return _LOADED[path]
    if recorded_state(path, config, chosen) != "current":
        write(render_all([config], report=lambda line: None, backends=MODULE_BACKENDS), folder,
              force=True)
    spec = importlib.util.spec_from_file_location(f"_curvgap_{config.name}_{backend}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _LOADED[path] = module
    return module
