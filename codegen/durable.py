"""Files written whole or not at all, as every writer of the toolkit writes them: a temporary
file beside the target (``.<name>.<random><suffix>``: unique, so that processes writing at
once never share one), flushed and fsynced, then ``os.replace`` over the target and the folder
fsynced. A reader sees the old file or the new one, never part of one; a process killed
while writing leaves at most the temporary file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside ``path`` (ending in ``suffix``: a plotting library reads the
    format from it) for the caller to write; when the block ends without error it is flushed
    and renamed over ``path`` in one step, else removed."""
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fchmod(handle.fileno(), 0o644)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_folder(path.parent)


def write_atomically(path: Path, text: str, suffix: str = ".tmp") -> None:
    """Write ``text`` to ``path`` whole or not at all (:func:`replacing`)."""
    with replacing(path, suffix) as temporary:
        temporary.write_text(text, encoding="utf-8")


def fsync_folder(path: Path) -> None:
    """Flush ``path``'s entries (a rename in it) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
