"""Files written whole or not at all, as every writer of the toolkit writes them: a temporary
file beside the target (``.<name>.<random><suffix>``: unique, so that processes writing at
once never share one), flushed and fsynced, then ``os.replace`` over the target and the folder
fsynced. A reader sees the old file or the new one, never part of one; a process killed
while writing leaves at most the temporary file."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path, suffix: str = ".tmp", mode: int | None = 0o644) -> Iterator[Path]:
    """A temporary path beside ``path`` (ending in ``suffix``: a plotting library reads the
    format from it) for the caller to write; when the block ends without error it is flushed,
    given ``mode`` (``None``: the user's umask decides, as for any new file) and renamed over
    ``path`` in one step, else removed."""
    temporary = _created(path, suffix)
    try:
        yield temporary
        with open(temporary, "rb+") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_folder(path.parent)


def _created(path: Path, suffix: str) -> Path:
    """A new empty file ``.<name>.<random><suffix>`` beside ``path`` (made by this call)."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return temporary
        except FileExistsError:
            continue


def write_atomically(path: Path, text: str, suffix: str = ".tmp",
                     mode: int | None = 0o644) -> None:
    """Write ``text`` to ``path`` whole or not at all (:func:`replacing`)."""
    with replacing(path, suffix, mode) as temporary:
        temporary.write_text(text, encoding="utf-8")


def fsync_folder(path: Path) -> None:
    """Flush ``path``'s entries (a rename in it) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
