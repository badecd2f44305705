"""Locks that say who holds them: :mod:`filelock` locks whose file names the holder's pid.

The data dir's ``rollbus.lock`` (:class:`stack.runtime.DataDirLock`) and the NATS store's
``<store>.lock`` (:class:`stack.nats_server.EmbeddedNats`) are both taken without waiting: a second
taker is refused at once with the first one's pid read from the file. :mod:`filelock` takes an
``flock`` on Unix (the kernel drops it when its process dies, however it dies; the descriptor is
not inherited by child processes) and its own kind of lock on Windows; the file is kept on release
(removing a lock file races with a process that has just opened it) and emptied, so that a free
lock names no holder.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from filelock import BaseFileLock, FileLock, Timeout

__all__ = ["BaseFileLock", "Timeout", "lock_holder", "pid_lock", "release_pid_lock"]


def _name_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def pid_lock(path: Path) -> BaseFileLock:
    """A lock on ``path`` that :meth:`~filelock.BaseFileLock.acquire` takes at once or not at all (raising
    :class:`filelock.Timeout`), writing this process's pid into the file when it does. Not tied to the
    thread that takes it (the stack releases it from another)."""
    return FileLock(path, timeout=0, thread_local=False, preserve_lock_file=True, on_acquired=_name_holder)


def lock_holder(path: Path) -> str:
    """The pid a held lock's file names (``"unknown"`` when it names none or cannot be read)."""
    try:
        return path.read_text(errors="replace").strip()[:32] or "unknown"
    except OSError:
        return "unknown"


def release_pid_lock(lock: BaseFileLock) -> None:
    """Empty the file (a free lock names no holder), then release the lock."""
    with contextlib.suppress(OSError):
        os.truncate(lock.lock_file, 0)
    lock.release()
