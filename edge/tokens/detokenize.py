"""Incremental detokenization: sampled token ids in, text out, as the tokens arrive.

A byte-level BPE token may hold part of a UTF-8 character, so decoding tokens one by
one would show U+FFFD for a character split across tokens. :class:`IncrementalDecoder`
decodes a small window (the tokens since the last complete character, behind one
earlier window of context for tokenizers whose decoders look back, such as
SentencePiece's leading space) and holds text back while it ends in an incomplete
character. The concatenation of its pieces is the decode of the whole sequence.

Like :meth:`edge.tokens.incremental.TemplateCodec.reply_text`, a trailing stop token
(``<|im_end|>``) is not text: it is held back until another token follows it, and
dropped at :meth:`IncrementalDecoder.flush`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop_token_ids: Collection[int] = ()) -> None:
        self._decode = decode
        self._stops = frozenset(stop_token_ids)
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens already turned into text

    def feed(self, token_ids: Sequence[int]) -> str:
        """The new text that ``token_ids`` complete ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text, at the end of the generation."""
        return self._advance(final=True)

    def _visible(self) -> int:
        end = len(self._ids)
        return end - 1 if end and self._ids[-1] in self._stops else end

    def _advance(self, *, final: bool) -> str:
        end = self._visible()
        if end <= self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:end])
        if not final and text.endswith(REPLACEMENT):
            return ""  # an incomplete character (or invalid bytes, which the next character ends)
        self._prefix, self._read = self._read, end
        return text[len(before):]
