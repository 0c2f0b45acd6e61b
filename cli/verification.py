"""The verification table of ``curvgap generate``: each generated module against
``torch.func`` at small sizes, skipped for a module verified before in the same form.

A pass is remembered by the SHA-256 of the module's text, of the checks'
(:mod:`curvgap.codegen.verify`), the sizes, the tolerance and the torch version, in
``$CURVGAP_CACHE`` (default ``~/.cache/curvgap``)``/verified.json``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from ..codegen import verify as checks
from ..codegen.verify import check_module
from ..derivations.config import Config, read_table
from ..models.model_checks import check_model, model_dims
from ..models.model_config import ModelConfig, is_model_table, validate_model

TOLERANCE = 1e-10
#: Sizes of the check: L, d, d_k, d_ff (and an embedding's features p, a head's classes c, a
#: cross-attention's rows of M, L_m) all differ; d is raised to a multiple of the heads.
BASE_DIMS = {"L": 3, "d": 6, "d_k": 4, "d_ff": 5, "p": 7, "c": 9}
CROSS_ROWS = 2


def verify_dims(config: Config) -> dict[str, int]:
    """The sizes a module of ``config`` is checked at: ``d`` divisible by its heads, ``d_k``
    by its rotary chunks (``2 / rotary_fraction`` of them), all four different."""
    L, d_ff = BASE_DIMS["L"], BASE_DIMS["d_ff"]
    chunks = round(2 / config.rotary_fraction) if config.rotary else 1
    d_k = BASE_DIMS["d_k"]
    while d_k % chunks or d_k in (L, d_ff):
        d_k += 1
    d = BASE_DIMS["d"]
    while d % config.heads or d in (L, d_k, d_ff):
        d += 1
    return {**BASE_DIMS, "d": d, "d_k": d_k,
            **({"L_m": CROSS_ROWS} if config.cross_attention else {})}


def _cache_file() -> Path:
    root = os.environ.get("CURVGAP_CACHE") or Path.home() / ".cache" / "curvgap"
    return Path(root) / "verified.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as handle:
            json.dump(cache, handle, indent=1)
        os.replace(handle.name, path)
    except OSError:
        pass  # a cache that cannot be written only costs a rerun next time


def _key(path: Path, dims: dict[str, int]) -> str:
    digest = hashlib.sha256(path.read_bytes())
    digest.update(Path(checks.__file__).read_bytes())  # new checks run on old modules too
    digest.update(json.dumps([dims, TOLERANCE, torch.__version__]).encode())
    return digest.hexdigest()


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_curvgap_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_models(paths: list[str] | None) -> tuple[list | None, list[ModelConfig]]:
    """``--config`` files with each model config (a file with ``depth``) replaced by its
    distinct sublayer configs (:meth:`ModelConfig.sublayers`): ``(files and configs, the
    model configs)``; None (every shipped config) as it is."""
    if paths is None:
        return None, []
    expanded, models = [], []
    for path in paths:
        table = read_table(path)
        if is_model_table(table):
            models.append(validate_model(table, str(path)))
            expanded += models[-1].sublayers()
        else:
            expanded.append(path)
    return expanded, models


def verify(paths: list[Path], configs: dict[str, Config],
           models: list[ModelConfig] = ()) -> bool:
    """Check each module of ``paths`` against torch.func (a module verified before is not
    run again), then each model of ``models`` as the chain of its parts against autograd on
    its plain-PyTorch twin (ties included): a line naming each before its checks and one
    with its result as they happen, then the table of all; whether all passed."""
    print(f"\nverification against torch.func (float64, B = 2, L = {BASE_DIMS['L']}, "
          f"d_ff = {BASE_DIMS['d_ff']}, d_k = {BASE_DIMS['d_k']} or the next multiple of the "
          "rotary chunks, d = 6 or the next multiple of the heads; tolerance 1e-10 "
          "relative):", flush=True)
    cache, ok, rows = _read_cache(), True, []
    for k, path in enumerate(paths, 1):
        config = configs[path.stem]
        dims = verify_dims(config)
        key = _key(path, dims)
        name = f"  [{k}/{len(paths)}] {path.stem} ({path.parent.name})"
        if key in cache:
            count, error, worst = cache[key]
            note = "(verified before)"
            print(f"{name}: verified before", flush=True)
        else:
            print(f"{name}: checking ...", flush=True)
            start = time.perf_counter()
            errors = check_module(config, _load_module(path), path.parent.name, dims)
            worst = max(errors, key=errors.get)
            count, error = len(errors), errors[worst]
            passed, seconds = error <= TOLERANCE, time.perf_counter() - start
            ok &= passed
            note = f"{'' if passed else 'FAILED  '}({seconds:.1f} s)"
            print(f"{name}: {count} checks, max rel. error {error:.2e} ({worst})"
                  f"{'' if passed else ', FAILED'}, {seconds:.1f} s", flush=True)
            if passed:
                cache[key] = [count, error, worst]
                _write_cache(cache)
        rows.append((path.stem, path.parent.name, count, error, f"{worst}  {note}"))
    for k, (model, backend) in enumerate([(m, b) for m in models for b in ("numpy", "torch")],
                                         1):
        name = f"  [model {k}/{2 * len(models)}] {model.name} ({backend})"
        print(f"{name}: checking the chain of its parts ...", flush=True)
        start = time.perf_counter()
        errors = check_model(model, backend, model_dims(model, verify_dims(model.block)))
        worst = max(errors, key=errors.get)
        passed, seconds = errors[worst] <= TOLERANCE, time.perf_counter() - start
        ok &= passed
        print(f"{name}: {len(errors)} checks, max rel. error {errors[worst]:.2e} ({worst})"
              f"{'' if passed else ', FAILED'}, {seconds:.1f} s", flush=True)
        rows.append((model.name, backend, len(errors), errors[worst],
                     f"{worst}  {'' if passed else 'FAILED  '}(model, {seconds:.1f} s)"))
    width = max([20, *(len(row[0]) for row in rows)]) + 2
    print(f"\n  {'module':<{width}}{'backend':<9}{'checks':>7}  {'max rel. error':>15}  worst")
    print("\n".join(f"  {name:<{width}}{backend:<9}{count:>7}  {error:>15.2e}  {rest}"
                    for name, backend, count, error, rest in rows), flush=True)
    return ok
