"""Heap settings for a long-running rollbus process: the garbage collector's, and malloc's.

CPython's cyclic collector runs every 700 net container allocations and walks every young
object; a full collection walks the whole heap. An edge allocates a few hundred containers a
turn (decoded messages, events, fold states) and holds a large, immortal startup heap (the
tokenizer's tables, compiled templates, imported modules). Measured on the edge benchmark,
collections took about a tenth of the edge's CPU, mostly re-walking that startup heap.

:func:`settle_heap` is called once startup is done: it moves everything alive into the
permanent generation (:func:`gc.freeze`: never scanned again, never freed) and lets the
young generation grow larger between collections. Reference counting still frees almost
everything at once; only cyclic garbage waits a little longer.

:meth:`HeapKeeper.for_process` fixes malloc's mmap threshold (:data:`MMAP_THRESHOLD`), and the
keeper runs beside the components of a stack: it gives back to the system the memory that big
requests left free in malloc's arenas (see its docstring). Measured by ``ops/bench/edge_memory.py
--big-requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
from typing import Protocol

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000


def settle_heap(young: int = YOUNG_THRESHOLD) -> None:
    """Freeze the startup heap and collect the young generation every ``young`` allocations."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)


# --- giving freed memory back -------------------------------------------------------------

TRIM_THRESHOLD = 64 * 1024 * 1024
"""Trim once the process holds this much more resident memory beyond what malloc has handed out than it did
after the last trim."""
TRIM_INTERVAL_S = 5.0
TRIM_ENV = "ROLLBUS_HEAP_TRIM_MIB"
"""The threshold in MiB (default 64); 0 leaves malloc as it is (no fixed mmap threshold, no keeper)."""
MMAP_THRESHOLD = 1024 * 1024
"""Allocations from this size get a mapping of their own, unmapped when freed (glibc's default starts at
128 KiB and rises to the largest block freed, up to 32 MiB: after one 16 MB body, every later one lands in
the heap and stays resident there)."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class Glibc:
    """What the keeper needs of glibc's malloc (how much it has handed out, and trimming it) and the RSS."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self._trim = libc.malloc_trim
        self._trim.argtypes = [ctypes.c_size_t]
        self._mallopt = libc.mallopt
        self._mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        self._page = os.sysconf("SC_PAGE_SIZE")

    @classmethod
    def load(cls) -> Glibc | None:
        """glibc's malloc (2.33 or later) on Linux, or None (musl, macOS, an older glibc: nothing is trimmed)."""
        try:
            libc = ctypes.CDLL(None)
            libc.mallinfo2, libc.malloc_trim, libc.mallopt  # noqa: B018 - they must exist
            with open("/proc/self/statm", "rb"):
                pass
        except (OSError, AttributeError):
            return None
        return cls(libc)

    def in_use_bytes(self) -> int:
        """What malloc has handed out and not had back, in its arenas and mapped alone (walks the arenas'
        bins: in a worker thread)."""
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def resident_bytes(self) -> int:
        """The process's RSS."""
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self._page

    def trim(self) -> None:
        """Give the free pages of every arena back (``malloc_trim(0)``; ctypes releases the GIL)."""
        self._trim(0)

    def fix_mmap_threshold(self, size: int) -> bool:
        """Allocations from ``size`` bytes mapped alone from now on (this also stops glibc moving its mmap
        and trim thresholds); whether malloc took it."""
        return bool(self._mallopt(_M_MMAP_THRESHOLD, size))


class Allocator(Protocol):
    def in_use_bytes(self) -> int: ...

    def resident_bytes(self) -> int: ...

    def trim(self) -> None: ...


def trim_due(slack: int, after_last_trim: int, threshold: int) -> bool:
    """Whether to trim: the slack (RSS less malloc's memory in use: memory freed but still resident, and
    what is not malloc's) grew by ``threshold`` since the last trim."""
    return slack - after_last_trim >= threshold


class HeapKeeper:
    """Gives the memory a burst of big work freed back to the system.

    glibc's malloc keeps what is freed for reuse, and a burst of big allocations (a 16 MB request
    body decoded; megabytes of text tokenized on a worker thread, whose tokenizer makes millions of
    small allocations in that thread's arena) leaves hundreds of MB free but resident, in the middle
    of arenas, where ``free`` never returns them. Every ``interval`` seconds the keeper compares the
    RSS with what malloc has handed out (in a worker thread: it walks the arenas); when the
    difference grew by ``threshold`` since the last trim, it trims (``malloc_trim(0)``: madvise of
    the free pages; 0.1-0.3 s for a few hundred MB, on that thread). Memory in use is never touched,
    growth in use never triggers a trim (RSS and use grow together), and a steady heap is never
    trimmed."""

    def __init__(self, allocator: Allocator, *, threshold: int = TRIM_THRESHOLD,
                 interval: float = TRIM_INTERVAL_S) -> None:
        self._allocator = allocator
        self._threshold = threshold
        self._interval = interval
        self._since = self.slack()
        self.trims = 0

    @classmethod
    def for_process(cls) -> HeapKeeper | None:
        """Malloc set up for a long-running process (:data:`MMAP_THRESHOLD`) and the keeper to run: None
        without glibc, or with ``ROLLBUS_HEAP_TRIM_MIB=0`` (malloc left as it is)."""
        mib = os.environ.get(TRIM_ENV, "").strip()
        threshold = int(mib) * 1024 * 1024 if mib.isdigit() else TRIM_THRESHOLD
        allocator = Glibc.load() if threshold > 0 else None
        if allocator is None:
            return None
        allocator.fix_mmap_threshold(MMAP_THRESHOLD)
        return cls(allocator, threshold=threshold)

    def slack(self) -> int:
        """RSS less malloc's memory in use."""
        in_use = self._allocator.in_use_bytes()
        return self._allocator.resident_bytes() - in_use

    def check(self) -> bool:
        """Trim if it is due; whether it did. Blocking: call it from a worker thread."""
        slack = self.slack()
        if not trim_due(slack, self._since, self._threshold):
            self._since = min(self._since, slack)  # reused: a later release counts from here
            return False
        self._allocator.trim()
        self._since = self.slack()
        self.trims += 1
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval`` seconds until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
                return
            if await asyncio.to_thread(self.check):
                log.debug("heap trimmed (%d so far)", self.trims)
