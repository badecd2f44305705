"""Garbage-collector settings for a long-running rollbus process.

CPython's cyclic collector runs every 700 net container allocations and walks every young
object; a full collection walks the whole heap. An edge allocates a few hundred containers a
turn (decoded messages, events, fold states) and holds a large, immortal startup heap (the
tokenizer's tables, compiled templates, imported modules). Measured on the edge benchmark,
collections took about a tenth of the edge's CPU, mostly re-walking that startup heap.

:func:`settle_heap` is called once startup is done: it moves everything alive into the
permanent generation (:func:`gc.freeze`: never scanned again, never freed) and lets the
young generation grow larger between collections. Reference counting still frees almost
everything at once; only cyclic garbage waits a little longer.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def settle_heap(young: int = YOUNG_THRESHOLD) -> None:
    """Freeze the startup heap and collect the young generation every ``young`` allocations."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)
