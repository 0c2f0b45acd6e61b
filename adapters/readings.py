"""The readings cache: a module's :class:`~.trace.Trace` for one kind of inputs, kept on disk
in ``$CURVGAP_CACHE/readings`` under what determines it — the module's code and structure
(:func:`~.fingerprint.fingerprint`, its weights apart), the kind of inputs
(:func:`~.trace.signature`: sizes are free), the loss, and the versions of torch and of
curvgap's reader — so that a new process answers a module it has read before without tracing
it again. A reading is checked against the call's sizes where the trace fixed any, and read
again if they differ. Files are pickles: loading one runs code, so the folder and the files
must be the user's, as the module cache's are."""

from __future__ import annotations

import functools
import hashlib
import pickle
import sys
from pathlib import Path

import sympy
import torch

from ..codegen.cache import CacheError, trusted_bytes, trusted_folder
from ..codegen.durable import replacing
from .fingerprint import NotPortable, fingerprint
from .trace import Trace


@functools.cache
def _reader_version() -> str:
    """A digest of the versions of Python, torch, SymPy and transformers and of the source of
    what reads a module (every file of :mod:`curvgap.adapters` and
    :mod:`curvgap.derivations`): a reading made by other code is not reused."""
    digest = hashlib.sha256(f"{sys.version}{torch.__version__}{sympy.__version__}".encode())
    transformers = sys.modules.get("transformers")  # library code a forward may reach
    digest.update(str(getattr(transformers, "__version__", "")).encode())
    for package in (Path(__file__).parent, Path(__file__).parents[1] / "derivations"):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def reading_key(module: torch.nn.Module, signature: tuple, loss: str) -> str | None:
    """The name of the reading of ``module`` for inputs of ``signature`` with ``loss``; None
    where the module holds a value no process-independent text captures (its reading is then
    not kept)."""
    try:
        structure = fingerprint(module, portable=True)
    except NotPortable:
        return None
    text = repr((structure, signature, loss, _reader_version()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_reading(key: str | None) -> Trace | None:
    """The reading stored under ``key``, or None (none stored, not the user's, unreadable)."""
    if key is None:
        return None
    try:
        data = trusted_bytes(trusted_folder("readings") / f"{key}.pkl")
    except CacheError:
        return None
    if data is None:
        return None
    try:
        found = pickle.loads(data)  # noqa: S301 - a file of the user's own cache, checked
    except Exception:  # noqa: BLE001 - a file from another version: read the module again
        return None
    return found if isinstance(found, Trace) else None


def store_reading(key: str | None, trace: Trace) -> None:
    """Keep ``trace`` under ``key`` (whole or not at all; not without a key); a cache that
    cannot be written is passed over (the reading is only slower next time)."""
    if key is None:
        return
    try:
        with replacing(trusted_folder("readings") / f"{key}.pkl", ".pkl") as temporary:
            temporary.write_bytes(pickle.dumps(trace, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - any failure to keep it: only slower next time
        return
