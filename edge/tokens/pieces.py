"""Piecewise encoding with a cache: the hot path tokenizes only text it has not seen.

A Hugging Face tokenizer extracts added tokens (``<|im_start|>``, ``<tool_response>``,
...) before it normalizes and pre-tokenizes, so the text between two added tokens is
encoded independently of everything around it. Encoding piece by piece is therefore
exact, and the pieces that repeat across turns and sessions (system prompts, tool
schemas, role headers) come from a cache. Tokenizers whose added tokens strip
neighbouring whitespace or match whole words only are encoded whole, uncached.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import tokenizers
import tokenizers.decoders

from edge.chat.cache import BoundedCache

Encode = Callable[[str], list[int]]

RELEASE_GIL_CHARS = 8192
"""Pieces from this long are encoded with ``encode_batch_fast``, which releases the GIL while it
works; ``Tokenizer.encode`` holds it throughout (1 MB of text: 1.6-2.7 s in which no other
thread of the process runs, the edge's event loop included). Shorter pieces take at most
~10 ms, and ``encode`` is the cheaper call for them. (``_fast``: without the character offsets,
which nothing here reads: the same ids, measured 20-30% sooner and with ~15% less memory at the
peak, ~250 bytes a token otherwise.)"""


class PiecewiseEncoder:
    def __init__(self, backend: tokenizers.Tokenizer, *, capacity: int = 16384,
                 max_bytes: int = 32 * 1024 * 1024) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added = {token.content: token_id for token_id, token in added.items()}
        plain = all(not (t.lstrip or t.rstrip or t.single_word) for t in added.values())
        alternatives = "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split if plain and alternatives else None
        # Pieces' ids; the added tokens (and the empty pieces between two of them) always there.
        pinned = {"": [], **{content: [token_id] for content, token_id in self._added.items()}}
        self._cache: BoundedCache[str, list[int]] = BoundedCache(max_items=capacity, max_bytes=max_bytes,
                                                                 pinned=pinned)

    def _whole(self, text: str) -> list[int]:
        if len(text) >= RELEASE_GIL_CHARS:
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        ids: list[int] = []
        known = self._cache.get
        for piece in self._split(text):
            found = known(piece)
            ids += found if found is not None else self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        """A piece not in the cache, encoded and remembered."""
        encoded = self._whole(piece)
        # a piece costs its text and ~36 bytes per token id (a list of Python ints)
        return self._cache.put(piece, encoded, len(piece) + 36 * len(encoded))


class ByteLevelDecoder:
    """Decoding for byte-level BPE without a round trip through the tokenizer: each id's
    bytes come from a table built once, and the joined bytes are decoded as UTF-8 (invalid
    sequences become U+FFFD, as the tokenizer's own ByteLevel decoder does).

    :meth:`build` returns None for a tokenizer whose decoder is not plain ByteLevel."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self.longest = max(map(len, table), default=0)  # the most bytes one id stands for

    @classmethod
    def build(cls, backend: tokenizers.Tokenizer, byte_of: dict[str, int]) -> ByteLevelDecoder | None:
        """``byte_of`` maps each character of the byte-level alphabet to its byte."""
        if not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
            return None
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        vocab = backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            if token in added:
                table[token_id] = token.encode()
            elif all(char in byte_of for char in token):
                table[token_id] = bytes(byte_of[char] for char in token)
            else:
                return None
        return cls(table)

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text, or None when an id is outside the vocabulary (let the tokenizer say why)."""
        table = self._table
        try:
            if ids and min(ids) < 0:
                return None
            return b"".join(map(table.__getitem__, ids)).decode("utf-8", errors="replace")
        except (IndexError, TypeError):
            return None
