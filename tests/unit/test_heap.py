"""The heap keeper: when it trims (pure, over a scripted allocator), and that a trim gives back what
glibc's malloc held free (the real allocator, on a heap fragmented the way a tokenizer leaves it)."""

from __future__ import annotations

import threading
import time

import pytest

from stack.heap import CHECK_SHARE, Glibc, HeapKeeper, trim_due

MIB = 1024 * 1024


class ScriptedAllocator:
    """RSS and memory in use as a test sets them; a trim gives back the slack above ``floor``."""

    def __init__(self, resident: int, in_use: int, floor: int) -> None:
        self.resident, self.in_use, self.floor = resident, in_use, floor
        self.trims = 0

    def in_use_bytes(self) -> int:
        return self.in_use

    def resident_bytes(self) -> int:
        return self.resident

    def trim(self) -> None:
        self.trims += 1
        self.resident = min(self.resident, self.in_use + self.floor)


def test_trim_is_due_when_the_slack_grew_by_the_threshold_and_stays_put() -> None:
    assert trim_due(164 * MIB, 170 * MIB, 100 * MIB, 64 * MIB)
    assert trim_due(164 * MIB, 120 * MIB, 100 * MIB, 64 * MIB)  # freed bit by bit
    assert not trim_due(164 * MIB, 90 * MIB, 100 * MIB, 64 * MIB)  # freed a moment ago: wait an interval
    assert not trim_due(163 * MIB, 170 * MIB, 100 * MIB, 64 * MIB)  # not enough
    assert not trim_due(170 * MIB, 240 * MIB, 100 * MIB, 64 * MIB)  # being taken again


def test_the_keeper_trims_after_big_work_ends_and_not_while_memory_is_in_use() -> None:
    heap = ScriptedAllocator(resident=300 * MIB, in_use=70 * MIB, floor=230 * MIB)
    keeper = HeapKeeper(heap, threshold=64 * MIB)
    heap.resident, heap.in_use = 2000 * MIB, 1770 * MIB  # a big request tokenizing: all of it in use
    assert not keeper.check()
    heap.in_use = 70 * MIB  # it ended: freed, still resident
    assert not keeper.check()  # one interval: another big request may take it again
    assert keeper.check() and heap.resident == 300 * MIB
    assert not keeper.check() and not keeper.check() and heap.trims == 1  # a steady heap is left alone
    heap.resident, heap.in_use = 700 * MIB, 470 * MIB  # live sessions holding their histories
    assert not keeper.check() and not keeper.check()
    heap.in_use = 420 * MIB  # one finalized: 50 MiB freed, under the threshold
    assert not keeper.check() and not keeper.check()
    heap.in_use = 370 * MIB  # another: 100 MiB freed since the last trim, 50 at a time
    assert keeper.check() and heap.resident == 600 * MIB and heap.trims == 2


def test_memory_freed_and_taken_again_by_the_next_big_request_is_left_to_it() -> None:
    heap = ScriptedAllocator(resident=300 * MIB, in_use=70 * MIB, floor=230 * MIB)
    keeper = HeapKeeper(heap, threshold=64 * MIB)
    for _ in range(3):  # big requests back to back: each frees ~1.7 GB, the next takes most of it again
        heap.resident, heap.in_use = 2000 * MIB, 70 * MIB
        assert not keeper.check()
        heap.in_use = 1500 * MIB
        assert not keeper.check()
        heap.in_use = 1770 * MIB
    heap.in_use = 70 * MIB  # the last one ended
    assert not keeper.check()
    assert keeper.check() and heap.trims == 1 and heap.resident == 300 * MIB


def test_a_release_after_memory_was_reused_counts_from_the_reuse() -> None:
    heap = ScriptedAllocator(resident=400 * MIB, in_use=100 * MIB, floor=230 * MIB)
    keeper = HeapKeeper(heap, threshold=64 * MIB)  # slack 300 MiB: freed memory not yet given back
    heap.in_use = 170 * MIB  # reused: slack 230 MiB
    assert not keeper.check()
    heap.in_use = 100 * MIB  # released again: slack 300 MiB, 70 MiB over what it was at the reuse
    assert not keeper.check()
    assert keeper.check() and heap.resident == 330 * MIB


def _fragment(keep: list[bytes], size: int) -> None:
    """``size`` bytes of 2 KiB blocks from malloc; one in 32 kept, so the rest frees holes in the
    middle of the heap that ``free`` alone cannot give back."""
    blocks = [bytes(2048) for _ in range(size // 2048)]
    keep.extend(blocks[::32])


def test_a_trim_gives_back_what_a_fragmented_glibc_heap_held_free() -> None:
    glibc = Glibc.load()
    if glibc is None:
        pytest.skip("not glibc's malloc")
    keeper = HeapKeeper(glibc, threshold=32 * MIB)
    keep: list[bytes] = []
    worker = threading.Thread(target=_fragment, args=(keep, 256 * MIB))  # a worker thread's arena, as tokenizing
    worker.start()
    worker.join()
    before = glibc.resident_bytes()
    assert not keeper.check()  # freed a moment ago: due once it stayed free an interval
    assert keeper.check()
    freed = before - glibc.resident_bytes()
    assert freed > 128 * MIB, f"the trim gave back {freed / MIB:.0f} MiB"
    assert not keeper.check()
    assert len(keep) == 256 * MIB // 2048 // 32


def test_dear_checks_are_spaced_out() -> None:
    class Slow(ScriptedAllocator):
        def in_use_bytes(self) -> int:
            started = time.thread_time()
            while time.thread_time() - started < 0.02:  # 20 ms of CPU walking the arenas
                pass
            return self.in_use

    keeper = HeapKeeper(Slow(resident=300 * MIB, in_use=70 * MIB, floor=230 * MIB), threshold=64 * MIB, interval=5.0)
    assert keeper.next_wait() == 5.0  # none measured yet
    keeper.check()
    assert keeper.check_cpu_s >= 0.02
    assert keeper.next_wait() >= 0.02 / CHECK_SHARE  # at most CHECK_SHARE of a core
    cheap = HeapKeeper(ScriptedAllocator(resident=300 * MIB, in_use=70 * MIB, floor=230 * MIB), interval=5.0)
    cheap.check()
    assert cheap.next_wait() == 5.0
