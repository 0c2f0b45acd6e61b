"""The module cache: generated modules made on first use into ``$CURVGAP_CACHE/modules``
(default ``~/.cache/curvgap/modules``), one file per module and backend, reused while current.

The storage (:func:`cached_module`) is apart from the key: a caller names a module by a hex
digest of what it computes (:func:`module_for`: a config's options) and gives a callable that
renders its files only when they are needed. The cache folder holds

- ``modules/<backend>/layer_<key><suffix>``: the module of ``key`` for ``backend``;
- ``modules/locks/<key>.lock``: the lock of ``key`` (empty, never removed).

Made for sharing by processes and users' jobs running at once:

- every file is written whole on its own: a temporary file in its folder, flushed and
  fsynced, then ``os.replace`` over the module's name and the folder fsynced. A reader sees
  no file, the old file or the new one, never part of one; a process killed while writing
  leaves at most a temporary file (``.layer_<key><suffix>.<random>.tmp``), removed by the next
  generation of that key;
- generating a key holds an exclusive ``flock`` on its lock file: concurrent first uses
  generate once, the others wait for the lock and load what it wrote. The system releases
  the lock of a process that dies. Loading a current module takes no lock;
- a module is used only when its header's content hash matches its body (and its recorded
  source hash is the caller's, when one is given); otherwise it is regenerated. Nothing else
  in the folder is read, so stray files or a corrupted sibling never matter;
- loading a module runs its code, and the header hash shows integrity, not origin. So the
  cache folder and the folders curvgap makes in it must be owned by the user (or root) and
  writable by no one else, or :class:`CacheError` refuses them; a module file owned by
  someone else, writable by others or a symbolic link is not trusted and is regenerated.

A process that generates a module says so in one line on stderr, what it generates and why
(the cache has no current module of it), completed by the time it took::

    curvgap: generating the torch code of GPT2Block's loss, gradient and curvature products:
    not in the module cache /home/me/.cache/curvgap/modules yet ... done in 14.2 s

(one line on screen). A module loaded from the cache says nothing. ``CURVGAP_QUIET=1`` in
the environment silences the line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType

from ..derivations.config import Config
from ..derivations.program import Program
from .backends import MODULE_BACKENDS
from .backends import backend as backend_named
from .durable import write_atomically
from .fused import fuse
from .generate import body_hash, render_all, source_hash, split_header

#: The modules loaded in this process, by path and whether fused (a chain of N equal parts
#: loads one).
_LOADED: dict[tuple[Path, bool], ModuleType] = {}

#: What a key must look like: a hex digest (it names files).
_KEY = re.compile(r"[0-9a-f]{8,128}")
#: The environment variable that, set to anything but "" or "0", silences the line a
#: generation prints.
QUIET = "CURVGAP_QUIET"
#: What a program's module computes, by its scope, in words.
SCOPES = {"products": "loss, gradient and curvature products",
          "blocks": "Jacobians, Hessian blocks and diagonals"}


class CacheError(RuntimeError):
    """The module cache cannot be used: its folder is not trusted, or cannot be written."""


def cache_root() -> Path:
    """The cache folder: ``$CURVGAP_CACHE``, or ``~/.cache/curvgap``."""
    return Path(os.environ.get("CURVGAP_CACHE") or Path.home() / ".cache" / "curvgap")


def _where() -> str:
    """How the cache folder was chosen, for messages."""
    return ("set by CURVGAP_CACHE" if os.environ.get("CURVGAP_CACHE")
            else "the default; CURVGAP_CACHE sets another")


def module_for(config: Config | Program, backend: str = "torch",
               fused: bool = False) -> ModuleType:
    """The generated ``backend`` module (``"torch"`` or ``"numpy"``) of ``config`` or of a
    program read from a module (generated once into the cache, named by the hash of what it
    computes, its options but its name, then reused; loaded once per process). A config's
    modules are rendered for every backend at once, a program's for the backend asked for
    (programs serve the torch layers and models they were read from). ``fused``: a copy of
    the torch module whose group functions run through ``torch.compile``
    (:func:`~curvgap.codegen.fused.fuse`)."""
    if isinstance(config, Program):
        key = config.fingerprint[:16]
    else:
        options = {**dataclasses.asdict(config), "name": ""}
        key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    named = dataclasses.replace(config, name=f"layer_{key}")
    chosen = _module_backend(backend)
    if isinstance(config, Program):
        what = f"the {chosen.name} code of {config.title}'s {SCOPES[config.scope]}"
    else:
        what = (f"the {' and '.join(b.name for b in MODULE_BACKENDS)} code of the config "
                f"{config.name!r}")

    def render() -> dict[str, str]:
        backends = (chosen,) if isinstance(named, Program) else MODULE_BACKENDS
        rendered = render_all([named], report=lambda line: None, backends=backends)
        return {item.backend: item.text for item in rendered}

    return cached_module(key, backend, render, source=lambda: source_hash(named, chosen),
                         what=what, fused=fused)


def cached_module(key: str, backend: str, render: Callable[[], Mapping[str, str]],
                  source: str | Callable[[], str] | None = None,
                  what: str | None = None, fused: bool = False) -> ModuleType:
    """The cached ``backend`` module named by ``key`` (a lowercase hex digest of what the
    module computes, 8 to 128 digits), loaded once per process.

    ``render()`` is called only when the cache has no current module of ``key``, under the
    key's lock: it returns the whole text of each file (header included, see
    :func:`~curvgap.codegen.generate.render`) by backend name (``"torch"``, ``"numpy"``),
    ``backend`` among them; every file it returns is stored. ``source`` is the source hash
    a current file records (or a callable giving it, called only when needed); without it
    any intact file of ``key`` is current, so ``key`` must then cover everything that shapes
    the text. ``what`` names the module in the line a generation prints (default: its
    key). ``fused`` (torch only): a module of its own, loaded from the same text, whose group
    functions are compiled (:func:`~curvgap.codegen.fused.fuse`)."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"key: expected a lowercase hex digest of 8 to 128 digits, got "
                         f"{key!r}")
    chosen = _module_backend(backend)
    if not isinstance(fused, bool) or (fused and chosen.name != "torch"):
        raise ValueError(f"fused: expected False, or True with the torch backend (it runs "
                         f"through torch.compile), got {fused!r} with {chosen.name!r}")
    folder = cache_root() / "modules"
    path = folder / chosen.name / f"layer_{key}{chosen.suffix}"
    if (path, fused) in _LOADED:
        return _LOADED[path, fused]
    expected = _Expected(source)
    _prepare(folder, [chosen.name])
    text = _current(path, expected)
    if text is None:
        text = _generate(folder, key, chosen.name, render, expected,
                         what or f"the {chosen.name} module {key}")
    module = _load(path, text, f"_curvgap_layer_{key}_{chosen.name}{'_fused' if fused else ''}")
    if fused:
        fuse(module)
    _LOADED[path, fused] = module
    return module


def _module_backend(name: str):
    names = [b.name for b in MODULE_BACKENDS]
    if name not in names:
        raise ValueError(f"backend: expected one of {names}, got {name!r}")
    return backend_named(name)


class _Expected:
    """The source hash a current file records, computed once, when first needed."""

    def __init__(self, source: str | Callable[[], str] | None) -> None:
        self._source, self._value = source, None

    def __call__(self) -> str | None:
        if self._value is None and self._source is not None:
            self._value = self._source() if callable(self._source) else self._source
        return self._value


# -- the folders ----------------------------------------------------------------------------

def _prepare(folder: Path, backends: list[str]) -> None:
    """Make (if missing) and check the cache folder, ``modules`` and the ``backends``'
    folders: each must be a folder of the user's (or root's) that no one else can write."""
    root = folder.parent
    for path in (root, folder, *(folder / name for name in backends)):
        try:
            path.mkdir(mode=0o755, parents=path == root, exist_ok=True)
        except OSError as error:
            raise CacheError(_cannot(f"make the folder {path}", error)) from None
        _check_trusted(path)


def _check_trusted(path: Path) -> None:
    """:class:`CacheError` unless ``path`` is a folder owned by the user or root and not
    writable by group or others."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise CacheError(_cannot(f"read {path}", error)) from None
    where = f"the module cache {cache_root()} ({_where()})"
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{where}: expected a folder at {path}, got a file")
    if info.st_uid not in (os.geteuid(), 0):
        raise CacheError(f"{where}: expected folders of your own, got {path} owned by user "
                         f"{info.st_uid}; loading a module runs its code, so curvgap uses "
                         "no cache another user can write: set CURVGAP_CACHE to a folder of "
                         "yours")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        writers = " and ".join(w for w, bit in (("group", stat.S_IWGRP),
                                                ("others", stat.S_IWOTH))
                               if info.st_mode & bit)
        raise CacheError(f"{where}: expected folders only you can write, got {path} "
                         f"(mode {stat.S_IMODE(info.st_mode):o}) writable by {writers}; "
                         f"loading a module runs its code: run chmod go-w {path}, or set "
                         "CURVGAP_CACHE to a folder of yours")


def _cannot(what: str, error: OSError) -> str:
    return (f"the module cache {cache_root()} ({_where()}): cannot {what}: "
            f"{error.strerror or error}; set CURVGAP_CACHE to a folder you can write")


# -- reading --------------------------------------------------------------------------------

def _current(path: Path, expected: _Expected) -> str | None:
    """The text of the module at ``path`` if it is trusted, intact and current, else None."""
    data = trusted_bytes(path)
    return None if data is None else _verified(data, expected)


def trusted_bytes(path: Path) -> bytes | None:
    """The bytes of the file at ``path`` if it is a plain file of the user's (or root's) that
    no one else can write (loading it runs code), else None."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (os.geteuid(), 0) or \
                info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        return path.read_bytes()
    except OSError:
        return None


def trusted_folder(name: str) -> Path:
    """The cache's folder ``name`` (made if missing), checked as the module folders are: the
    user's (or root's), writable by no one else."""
    folder = cache_root() / name
    _prepare(folder, [])
    return folder


def _verified(data: bytes, expected: _Expected) -> str | None:
    """``data`` as text if its header's content hash matches its body (and its source hash
    is the expected one), else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    fields, body = split_header(text)
    if fields.get("content-hash") != body_hash(body):
        return None
    wanted = expected()
    if wanted is not None and fields.get("source-hash") != wanted:
        return None
    return text


def _load(path: Path, text: str, name: str) -> ModuleType:
    """A module made from ``text`` (the verified bytes, not the file read again)."""
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


# -- writing --------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(folder: Path, key: str) -> Iterator[None]:
    """Hold the exclusive lock of ``key`` (waiting for another process that holds it)."""
    locks = folder / "locks"
    _prepare(folder, ["locks"])
    path = locks / f"{key}.lock"
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
    except OSError as error:
        raise CacheError(_cannot(f"open the lock {path}", error)) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _generate(folder: Path, key: str, backend: str, render: Callable[[], Mapping[str, str]],
              expected: _Expected, what: str) -> str:
    """Under the lock of ``key``: the text of its ``backend`` module, as another process
    wrote it while this one waited, or rendered and written here (saying so,
    :func:`announced`)."""
    path = folder / backend / f"layer_{key}{backend_named(backend).suffix}"
    with _locked(folder, key):
        text = _current(path, expected)
        if text is not None:
            return text
        with announced(f"generating {what}: not in the module cache {folder} yet"):
            return _write(folder, key, backend, render, expected)


@contextlib.contextmanager
def announced(step: str) -> Iterator[None]:
    """One line on stderr around a long ``step`` (``"generating ..."``), on a terminal or
    not: the step, then how long it took (or that it failed); nothing when :data:`QUIET` is
    set."""
    if os.environ.get(QUIET, "") not in ("", "0"):
        yield
        return
    print(f"curvgap: {step} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def say(line: str) -> None:
    """``line`` on stderr (what a long step did), unless :data:`QUIET` is set."""
    if os.environ.get(QUIET, "") in ("", "0"):
        print(f"curvgap: {line}", file=sys.stderr, flush=True)


def _write(folder: Path, key: str, backend: str, render: Callable[[], Mapping[str, str]],
           expected: _Expected) -> str:
    """Render the files of ``key`` and write them; the text of its ``backend`` module."""
    files = _checked(render(), backend, expected)
    _prepare(folder, list(files))
    for name, content in files.items():
        target = folder / name / f"layer_{key}{backend_named(name).suffix}"
        _remove_temporaries(target)
        try:
            if target.is_symlink() or not target.is_file() or \
                    target.read_bytes() != content.encode("utf-8"):
                write_atomically(target, content)
        except OSError as error:
            raise CacheError(_cannot(f"write {target}", error)) from None
    return files[backend]


def _checked(files: Mapping[str, str], backend: str, expected: _Expected) -> dict[str, str]:
    """The files ``render()`` returned, checked: ``backend`` among them, every name a module
    backend, every text with an intact header (and the expected source hash for
    ``backend``)."""
    names = [b.name for b in MODULE_BACKENDS]
    if not isinstance(files, Mapping) or backend not in files:
        given = (f"the backends {sorted(files)}" if isinstance(files, Mapping)
                 else type(files).__name__)
        raise CacheError(f"render: expected the files' texts by backend name, {backend!r} "
                         f"among them, got {given}")
    out = {}
    for name, text in files.items():
        if name not in names or not isinstance(text, str):
            raise CacheError(f"render: expected texts (str) of the backends {names}, got "
                             f"{type(text).__name__} for {name!r}")
        fields, body = split_header(text)
        if fields.get("content-hash") != body_hash(body):
            raise CacheError(f"render: expected each text to start with a curvgap header "
                             f"whose content hash is its body's, got another for {name!r}")
        out[name] = text
    if _verified(out[backend].encode("utf-8"), expected) is None:
        raise CacheError(f"render: expected the {backend!r} text to record the source hash "
                         f"{expected()}, got {split_header(out[backend])[0].get('source-hash')}")
    return out


def _remove_temporaries(path: Path) -> None:
    """Remove what a killed writer of ``path`` left (only a lock holder writes it)."""
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        leftover.unlink(missing_ok=True)


