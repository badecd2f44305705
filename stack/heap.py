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

:meth:`HeapKeeper.for_process` fixes malloc's mmap and trim thresholds, and the
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
import time
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

TRIM_THRESHOLD = 32 * 1024 * 1024
"""Trim once the process holds this much more resident memory beyond what malloc has handed out than it did
after the last trim."""
TRIM_INTERVAL_S = 5.0
CHECK_SHARE = 0.002
"""The most of one core the keeper's checks may take: a check that walked the arenas for ``t`` seconds of CPU
waits at least ``t / CHECK_SHARE`` before the next (measured on the edge benchmark: 80 ms a check on a loaded
machine, every 5 s, was 3 % of the edge's CPU)."""
TRIM_ENV = "ROLLBUS_HEAP_TRIM_MIB"
"""The threshold in MiB (default 32); 0 leaves malloc as it is (no fixed thresholds, no keeper)."""
MMAP_THRESHOLD = 32 * 1024 * 1024
"""Allocations from this size get a mapping of their own, unmapped when freed: the most glibc moves its
threshold to (it starts at 128 KiB and follows the largest block freed), fixed so that the trim threshold
stays fixed too. A lower one costs CPU: at 4 MiB, each 16 MB body's buffers mapped and faulted in anew
took 4.5 s of CPU for four of them against 3.1 s at 32 MiB (2.3 s with glibc's own thresholds)."""
HEAP_TRIM_THRESHOLD = 8 * 1024 * 1024
"""Free memory at the top of a heap past this goes back to the system on ``free``. glibc moves its own
with the mmap threshold, to 64 MiB: each worker thread's arena (tokenizing runs on worker threads) then
keeps up to that much at its top however idle it is, which ``malloc_trim`` does not give back (it gives
back free pages in the middle of arenas, and the main heap's top)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


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

    def fix_thresholds(self, mmap: int, trim: int) -> bool:
        """Allocations from ``mmap`` bytes mapped alone, and free memory past ``trim`` bytes at the top of a
        heap given back, from now on (glibc stops moving either); whether malloc took them."""
        return bool(self._mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(self._mallopt(_M_TRIM_THRESHOLD, trim))


class Allocator(Protocol):
    def in_use_bytes(self) -> int: ...

    def resident_bytes(self) -> int: ...

    def trim(self) -> None: ...


def trim_due(slack: int, previous: int, since: int, threshold: int) -> bool:
    """Whether to trim, from the slack (RSS less malloc's memory in use: memory freed but still resident,
    and what is not malloc's) now, at the previous check, and after the last trim: it grew by
    ``threshold`` since that trim, and moved less than that over the last interval (memory freed a
    moment ago, or being taken again, as by big requests coming one after another, is left alone)."""
    return slack - since >= threshold and abs(slack - previous) < threshold


class HeapKeeper:
    """Gives the memory a burst of big work freed back to the system.

    glibc's malloc keeps what is freed for reuse, and a burst of big allocations (a 16 MB request
    body decoded; megabytes of text tokenized on a worker thread, whose tokenizer makes millions of
    small allocations in that thread's arena) leaves hundreds of MB free but resident, in the middle
    of arenas, where ``free`` never returns them. Every ``interval`` seconds the keeper compares the
    RSS with what malloc has handed out (in a worker thread: it walks the arenas, holding each one's
    lock meanwhile; measured 15-40 ms with 2.7 GB free in them, 10 ms in a quiet edge; checks that dear are
    spaced out so that they take at most :data:`CHECK_SHARE` of a core); when the difference grew by
    ``threshold`` since the last trim and has stayed put since the previous check (:func:`trim_due`), it
    trims (``malloc_trim(0)``: madvise of the free pages; 0.15 s for 1.3 GB, on that thread). Memory
    in use is never touched, growth in use never triggers a trim (RSS and use grow together), memory
    that the next big request is taking again is left to it (trimming between back-to-back 16 MB
    requests cost a quarter more CPU: each faulted its memory in anew), and a steady heap is never
    trimmed."""

    def __init__(self, allocator: Allocator, *, threshold: int = TRIM_THRESHOLD,
                 interval: float = TRIM_INTERVAL_S) -> None:
        self._allocator = allocator
        self._threshold = threshold
        self._interval = interval
        self._since = self._previous = self.slack()
        self.trims = 0
        self.check_cpu_s = 0.0  # CPU time the last check took

    @classmethod
    def for_process(cls) -> HeapKeeper | None:
        """Malloc set up for a long-running process (:data:`MMAP_THRESHOLD`, :data:`HEAP_TRIM_THRESHOLD`) and
        the keeper to run: None without glibc, or with ``ROLLBUS_HEAP_TRIM_MIB=0`` (malloc left as it is)."""
        mib = os.environ.get(TRIM_ENV, "").strip()
        threshold = int(mib) * 1024 * 1024 if mib.isdigit() else TRIM_THRESHOLD
        allocator = Glibc.load() if threshold > 0 else None
        if allocator is None:
            return None
        allocator.fix_thresholds(MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD)
        return cls(allocator, threshold=threshold)

    def slack(self) -> int:
        """RSS less malloc's memory in use."""
        in_use = self._allocator.in_use_bytes()
        return self._allocator.resident_bytes() - in_use

    def check(self) -> bool:
        """Trim if it is due; whether it did. Blocking: call it from a worker thread."""
        started = time.thread_time()
        slack = self.slack()
        self.check_cpu_s = time.thread_time() - started
        due = trim_due(slack, self._previous, self._since, self._threshold)
        self._previous = slack
        if not due:
            self._since = min(self._since, slack)  # reused: a later release counts from here
            return False
        self._allocator.trim()
        self._since = self._previous = self.slack()
        self.trims += 1
        return True

    def next_wait(self) -> float:
        """Seconds until the next check: the interval, longer when checks are dear (:data:`CHECK_SHARE`)."""
        return max(self._interval, self.check_cpu_s / CHECK_SHARE)

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval`` seconds (or less often: :meth:`next_wait`) until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.next_wait())
                return
            if await asyncio.to_thread(self.check):
                log.debug("heap trimmed (%d so far)", self.trims)
