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

import ctypes
import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


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
        _fsync_folder(out.parent)
        recover(out)
    except OSError:
        pass


def write_file(path: Path, text: str) -> None:
    """Write one file whole or not at all: a flushed temporary beside it, then a rename."""
    temporary = path.with_name(f".{path.name}.curvgap-new")
    try:
        _write_durably(temporary, text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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


def _fsync_folder(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
