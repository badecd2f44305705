"""A continued chain's engine input, grown in place instead of joined again every turn.

The engine must see a chain's whole token sequence every turn (prompt, every turn's context
and sampled tokens, then the new increment). Joining the chain's segments again costs a copy
of the whole chain each turn: a few milliseconds at 300 turns and 450k tokens. An
:class:`InputBuffer` keeps the ids of one chain in a ``uint32`` array with room to grow
(capacity grows by half), appends only the segments the chain gained since the last turn, and
hands out a view of its first ids: the copy per turn is what is new.

It is an optimization with no say: the fold state is the truth. The buffer knows which
segments it holds (their number, and the last of them *by identity*: a fold appends to a
chain by building a new tuple of the same segment objects, so the same object in the same
place means the same prefix); a chain that changed otherwise (a rollback) is copied afresh.
A view handed out keeps its ids: growing allocates a new array; a committed turn's increment
is rewritten only with itself (it became the chain's context); a failed turn's increment is
never overwritten in place (the array is copied first); a rollback rebuilds into a new array.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from schemas import tokens
from session.fold import ChainState, Segment

MIN_TOKENS = 32 * 1024  # shorter chains are joined (cheaply) as before: no buffer to hold


class InputBuffer:
    __slots__ = ("_handed", "_ids", "_last", "_length", "_prompt", "_segments")

    def __init__(self) -> None:
        self._ids: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self._length = 0  # ids of the chain held (prompt and segments), before any increment
        self._segments = 0  # segments of the chain held
        self._last: Segment | None = None  # the last of them
        self._prompt: bytes | None = None
        self._handed = 0  # ids handed out by the last call (the chain's, then that turn's increment)

    def input_ids(self, chain: ChainState, increment: bytes) -> npt.NDArray[np.uint32]:
        """The chain's ids followed by ``increment`` (packed), as a view the engine reads."""
        segments = chain.segments
        held = self._segments
        if (chain.prompt_ids is not self._prompt or len(segments) < held
                or (held and segments[held - 1] is not self._last)):
            self._rebuild(chain)
        else:
            for segment in segments[held:]:
                self._append(segment.token_ids)
            self._segments = len(segments)
            self._last = segments[-1] if segments else None
        if self._length < self._handed:  # the last increment never joined the chain (that turn failed):
            self._ids = self._ids.copy()  # its view keeps what it was handed
        end = self._length + tokens.count(increment)
        self._reserve(end)
        self._ids[self._length:end] = tokens.unpack_ids(increment)
        self._handed = end
        return self._ids[:end]

    def _rebuild(self, chain: ChainState) -> None:
        packed = chain.packed_ids()
        self._ids = np.empty(max(16, tokens.count(packed) * 3 // 2), dtype=np.uint32)  # a new array: old views stay
        self._length = 0
        self._append(packed)
        self._segments = len(chain.segments)
        self._last = chain.segments[-1] if chain.segments else None
        self._prompt = chain.prompt_ids

    def _append(self, packed: bytes) -> None:
        end = self._length + tokens.count(packed)
        self._reserve(end)
        self._ids[self._length:end] = tokens.unpack_ids(packed)
        self._length = end

    def _reserve(self, size: int) -> None:
        if size > len(self._ids):
            grown = np.empty(max(size, len(self._ids) * 3 // 2, 16), dtype=np.uint32)
            grown[: self._length] = self._ids[: self._length]
            self._ids = grown
