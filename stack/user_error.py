"""A mistake the user can fix (a busy port, an unwritable ``--data-dir``, a missing model) is a
:class:`UserError`: the CLI prints its message as one line on stderr and exits 2, never with
a traceback. Raised while the stack starts (:mod:`stack.runtime`) and by the CLI's tools.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from schemas.errors import UserError


def one_line(text: str) -> str:
    """``text`` with its whitespace runs (newlines included) folded to single spaces."""
    return " ".join(text.split())


def check_writable_dir(path: Path, *, flag: str, subdirs: tuple[str, ...] = ()) -> None:
    """Create ``path`` if needed and make sure files can be written there (and in its existing ``subdirs``).

    Raises :class:`UserError` naming ``flag`` when it is a file, lies under one, or cannot be
    written (permissions, a read-only file system). Root passes permission checks, so the
    check writes a file rather than asking :func:`os.access`.
    """
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create it ({_reason(exc)})") from exc
    for directory in (path, *(path / sub for sub in subdirs if (path / sub).is_dir())):
        try:
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".rollbus-write-check-")
        except OSError as exc:
            raise UserError(f"{flag} {path}: cannot write in {directory} ({_reason(exc)})") from exc
        os.close(fd)
        os.unlink(probe)


def _reason(exc: OSError) -> str:
    if isinstance(exc, NotADirectoryError):
        return "a part of the path is a file"
    return (exc.strerror or str(exc)).lower()
