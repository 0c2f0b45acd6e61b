"""The output folder, switched whole: from its old state to its new one, or not at all.

A generation builds the new state of the folder beside it (``.<name>.curvgap-new``: a copy of
what the folder holds, with the new files written over it, every file flushed to disk), then
exchanges the two paths in one system call (Linux ``renameat2(RENAME_EXCHANGE)``) and removes
the old state, now at ``.<name>.curvgap-old``. Killed at any instant, the folder is the whole
old state or the whole new one; what is left beside it is removed by the next run, and
``curvgap generate --check`` reports it. Where the exchange is not available, two renames do
the switch, after a marker beside the folder says that the new state is complete: a run that
finds the folder missing completes the switch (or undoes it).

Only a folder of curvgap's own files is switched: new or empty, or holding the backend
folders, ``__init__.py`` files and generated files (anything else is refused, so that no
other file of the user's is ever moved).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import durable
from .durable import fsync_folder


class OutputError(RuntimeError):
    """The output folder cannot be written; it was left as it was."""


def beside(out: Path, role: str) -> Path:
    """The path next to ``out`` of its new state (``role="new"``), its old state (``"old"``)
    or the marker saying that the new state is complete (``"complete"``)."""
    return out.parent / f".{out.name}.curvgap-{role}"


def leftovers(out: Path) -> list[str]:
    """What an interrupted run left beside ``out``, in words (empty when nothing)."""
    found = []
    if beside(out, "new").exists():
        found.append(f"{beside(out, 'new')} (a run stopped before its switch)")
    if beside(out, "old").exists():
        found.append(f"{beside(out, 'old')} (a run stopped after its switch)")
    if beside(out, "complete").exists():
        found.append(f"{beside(out, 'complete')} (a run stopped during its switch)")
    return found


def recover(out: Path) -> None:
    """Finish what an interrupted run left: complete a half-done two-rename switch (or undo
    it), then remove the states beside ``out``."""
    new, old, complete = (beside(out, role) for role in ("new", "old", "complete"))
    if not out.exists():
        if complete.exists() and new.exists():
            _rename(new, out)
        elif old.exists():
            _rename(old, out)
    for path in (new, old, complete):
        if path.exists() or path.is_symlink():
            _remove(path)


def check_foreign(out: Path, backends: Iterable[str], header: str,
                  replaced: Iterable[str] = ()) -> None:
    """:class:`OutputError` if ``out`` holds anything curvgap did not write (other than the
    files at the relative paths ``replaced``, which are judged apart)."""
    if not out.exists():
        return
    names, replaced = set(backends), {out / r for r in replaced}
    for entry in out.iterdir():
        if entry.name in ("__init__.py", "__pycache__"):
            continue
        if entry.name not in names or not entry.is_dir() or entry.is_symlink():
            _foreign(out, entry)
        for item in entry.iterdir():
            if item.name in ("__init__.py", "__pycache__"):
                continue
            if not item.is_file() or item.is_symlink():
                _foreign(out, item)
            if item not in replaced and not _starts_with(item, header):
                _foreign(out, item)


def switch(out: Path, files: dict[str, str]) -> None:
    """Make ``out`` its present content with ``files`` (relative path → text) written over
    it, in one step."""
    new = beside(out, "new")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        _copy_tree(out, new)
    else:
        new.mkdir()
    for relative, text in files.items():
        path = new / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_durably(path, text)
    _write_durably(beside(out, "complete"), "")
    if not out.exists():
        _rename(new, out)
    else:
        _exchange(new, out)
    try:  # switched: what fails from here on is left for the next run (and --check) to clean
        fsync_folder(out.parent)
        recover(out)
    except OSError:
        pass


def write_file(path: Path, text: str) -> None:
    """Write one file whole or not at all: a flushed temporary beside it, then a rename.
    :class:`OutputError` if ``path`` is a symbolic link (never written through)."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix) for the caller to write; when the
    block ends without error, it is flushed and renamed over ``path`` in one step, else
    removed (:func:`~.durable.replacing`), its mode the user's umask's; what a killed run
    left beside it removed first. :class:`OutputError` if ``path`` is a symbolic link (never
    written through) or a folder."""
    check_files(path.parent, [path.name])
    for leftover in path.parent.glob(f".{path.name}.*{path.suffix}"):  # a killed run's
        leftover.unlink(missing_ok=True)
    with durable.replacing(path, path.suffix, mode=None) as temporary:
        yield temporary


def check_files(folder: Path, names: Iterable[str], option: str = "--out") -> None:
    """:class:`OutputError` if a file ``folder/name`` to be written is a symbolic link
    (curvgap never writes through one, nor replaces it unasked) or a folder."""
    for name in names:
        path = folder / name
        if path.is_symlink():
            raise OutputError(f"{option}: expected {str(path)!r} to be a file or absent, got a "
                              f"symbolic link to {os.readlink(path)!r}; curvgap does not write "
                              "through links: remove it or choose another folder")
        if path.is_dir():
            raise OutputError(f"{option}: expected {str(path)!r} to be a file or absent, got "
                              "a folder; remove it or choose another folder")


def check_folder(out: Path, option: str = "--out") -> None:
    """:class:`OutputError` unless ``out`` is a folder, or a path where one can be made: a
    file or a link to nothing there, a file on the way to it (``afile.txt/sub``) or a
    folder on the way that cannot be written are refused, before any work is done."""
    if out.is_symlink() and not out.exists():
        raise OutputError(f"{option}: expected a folder, got {str(out)!r}, a symbolic link "
                          f"to the missing {os.readlink(out)!r}")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{option}: expected a folder, got {str(out)!r}, which is a "
                              "file")
        return
    existing = next(p for p in out.parents if p.exists() or p.is_symlink())
    if not existing.is_dir():
        what = "a file" if existing.exists() else "a symbolic link to nothing"
        raise OutputError(f"{option}: expected a folder path, got {str(out)!r}, but "
                          f"{str(existing)!r} is {what}: no folder can be made under it")
    _check_writable(out, existing, option)


def check_switchable(out: Path, option: str = "--out") -> None:
    """:class:`OutputError` unless the folder ``out`` (checked by :func:`check_folder`) can
    be switched whole, its new state made beside it and exchanged with it: not the current
    folder or one above it (that would take the folder away from under this process), not
    the root or a mount point, and the folder holding it writable."""
    real = Path(os.path.realpath(out))
    here = Path(os.getcwd())
    if real == here or real in here.parents:
        where = "the current folder" if real == here else "a folder above the current one"
        raise OutputError(f"{option}: expected a folder of its own (generation replaces it "
                          f"whole), got {str(out)!r}, {where} ({real}); name a folder for "
                          "the generated files, such as --out generated-modules")
    if real == real.parent or os.path.ismount(real):
        raise OutputError(f"{option}: expected a folder that can be replaced whole, got "
                          f"{str(out)!r}, a mount point ({real}); name a folder inside it")
    if real.exists():
        _check_writable(out, real.parent, option)


def _check_writable(out: Path, folder: Path, option: str) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{option}: expected a folder that can be written, got "
                          f"{str(out)!r}, but {str(folder)!r} cannot be written")


def _copy_tree(source: Path, target: Path) -> None:
    shutil.copytree(source, target, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))


def _rename(source: Path, target: Path) -> None:
    os.rename(source, target)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _exchange(a: Path, b: Path) -> None:
    """Swap the paths ``a`` and ``b`` atomically (two renames where the system cannot); the
    old state of ``b`` ends up at ``beside(b, "old")``."""
    old = beside(b, "old")
    if _swap(a, b):
        try:
            _rename(a, old)
        except OSError:
            pass  # left for the next run: a is removed as a leftover either way
        return
    _rename(b, old)
    try:
        _rename(a, b)
    except OSError:
        _rename(old, b)
        raise


def _swap(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False where the system or filesystem lacks it."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _starts_with(path: Path, header: str) -> bool:
    with open(path, "rb") as handle:
        return header.encode() in handle.read(200)


def _foreign(out: Path, entry: Path) -> None:
    raise OutputError(
        f"--out: expected a new or empty folder, or one holding only curvgap's generated "
        f"files, but {str(out)!r} holds {str(entry.relative_to(out))!r}, which curvgap did "
        "not write; choose another folder")
