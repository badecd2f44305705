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
from collections.abc import Callable

import tokenizers

Encode = Callable[[str], list[int]]


class PiecewiseEncoder:
    def __init__(self, backend: tokenizers.Tokenizer, *, capacity: int = 16384, max_piece: int = 65536) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._added = {token.content: token_id for token_id, token in added.items()}
        plain = all(not (t.lstrip or t.rstrip or t.single_word) for t in added.values())
        alternatives = "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
        self._split = re.compile(f"({alternatives})").split if plain and alternatives else None
        self._cache: dict[str, list[int]] = {}
        self._capacity = capacity
        self._max_piece = max_piece

    def _whole(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        ids: list[int] = []
        for piece in self._split(text):
            if not piece:
                continue
            token_id = self._added.get(piece)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        encoded = self._whole(piece)
        if len(piece) <= self._max_piece:
            if len(self._cache) >= self._capacity:
                self._cache.clear()
            self._cache[piece] = encoded
        return encoded
