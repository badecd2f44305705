"""A chain's tokens as the session page draws them: per token its text piece, id, mask and log prob. Pure.

Token texts come from the session's tokenizer, one token at a time; a token that ends inside a
UTF-8 character (byte-level BPE splits characters across tokens) is given the empty text and the
character goes to the token that completes it, so the pieces joined are the chain's decoded text.

A window lists the images that stand in it (:class:`ImageSpan`): each at the offset of its first
``<|image_pad|>`` in the part, with its token count, so the page draws the image there (fetched
from the log's object store by digest) in place of its placeholder tokens.

A window is a bounded run of one part of a chain (``prompt`` or ``response``): the page shows
the first one and asks for the next ones on demand, so a million-token chain never goes out whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import msgspec

from schemas import tokens
from schemas.errors import MalformedRequest
from session.fold import ChainState

Decode = Callable[[Sequence[int]], str]

WINDOW = 2000  # tokens of a part shown at first
MAX_WINDOW = 10000  # the most tokens one window holds
MAX_PENDING = 4  # tokens held back at most while their bytes do not end on a whole character
PARTS = ("prompt", "response")


class ImageSpan(msgspec.Struct, frozen=True, kw_only=True):
    """An image in a window: its first ``<|image_pad|>`` at ``offset`` in the part, ``tokens`` pads."""

    digest: str
    media_type: str
    width: int
    height: int
    offset: int
    tokens: int


class TokenWindow(msgspec.Struct, frozen=True, kw_only=True):
    part: str  # "prompt" | "response"
    offset: int  # index of the window's first token in its part
    length: int  # tokens of the whole part
    ids: list[int]
    text: list[str] | None  # None: no tokenizer to decode them with
    mask: list[int]  # 1: sampled by the model, 0: context (continuation); prompt tokens are 0
    logprobs: list[float | None] | None  # sampled tokens' log probs (None on context); None: none recorded
    turn_starts: list[int]  # response offsets (in this window) where a turn's tokens begin
    next_offset: int | None  # where the next window starts; None at the end of the part
    images: list[ImageSpan] = []  # the images whose placeholder runs meet this window, in order


def token_texts(ids: Sequence[int], decode: Decode) -> list[str]:
    """One text piece per id; their concatenation is ``decode(ids)`` for a byte-level tokenizer."""
    pieces: list[str] = []
    pending: list[int] = []
    for token_id in ids:
        pending.append(token_id)
        text = decode(pending)
        if text.endswith("\ufffd") and len(pending) < MAX_PENDING:
            pieces.append("")  # its bytes end inside a character: shown with the token completing it
            continue
        pieces.append(text)
        pending = []
    if pending:  # the part ends inside a character: what there is goes on its last token
        pieces[-1] = decode(pending)
    return pieces


def parse_window(part: str | None, offset: str | None, limit: str | None) -> tuple[str, int, int]:
    """``(part, offset, limit)`` of a window request; :class:`MalformedRequest` when out of bounds."""
    part = part or "response"
    if part not in PARTS:
        raise MalformedRequest(f"part: prompt or response, not {part[:40]!r}", param="part")
    numbers = []
    for name, text, default, low, high in (("offset", offset, 0, 0, 2**40), ("limit", limit, WINDOW, 1, MAX_WINDOW)):
        try:
            value = default if text in (None, "") else int(text)  # type: ignore[arg-type]
        except ValueError:
            raise MalformedRequest(f"{name}: not an integer: {str(text)[:40]!r}", param=name) from None
        if not low <= value <= high:
            raise MalformedRequest(f"{name}: must be {low} to {high}, not {value}", param=name)
        numbers.append(value)
    return part, numbers[0], numbers[1]


def _segments(chain: ChainState) -> Iterator[tuple[int, int, bytes, bool, bytes | None, bool]]:
    """(start, length, ids, generated, logprobs, starts a turn) of each response segment."""
    turn_firsts = {turn.first_segment for turn in chain.turns}
    start = 0
    for index, segment in enumerate(chain.segments):
        length = segment.length
        yield start, length, segment.token_ids, segment.generated, segment.logprobs, index in turn_firsts
        start += length


def window(chain: ChainState, decode: Decode | None, *, part: str = "response", offset: int = 0,
           limit: int = WINDOW) -> TokenWindow:
    """Tokens ``[offset, offset + limit)`` of the chain's prompt or response."""
    if part == "prompt":
        ids = tokens.unpack_ids(chain.prompt_ids)[offset: offset + limit].tolist()
        return _window(part, offset, chain.prompt_len, ids, [0] * len(ids), None, [], decode,
                       _images(chain, part, offset, len(ids)))
    end = offset + limit
    ids, mask, logprobs, starts = [], [], [], []
    has_logprobs = any(s.generated for s in chain.segments) and all(
        s.logprobs is not None for s in chain.segments if s.generated)
    for start, length, packed, generated, packed_logprobs, turn_start in _segments(chain):
        if start + length <= offset or start >= end:
            continue
        low, high = max(offset, start) - start, min(end, start + length) - start
        if turn_start and low == 0:
            starts.append(start - offset)
        ids += tokens.unpack_ids(packed)[low:high].tolist()
        mask += [int(generated)] * (high - low)
        if generated and packed_logprobs is not None:
            logprobs += tokens.unpack_logprobs(packed_logprobs)[low:high].tolist()
        else:
            logprobs += [None] * (high - low)
    return _window(part, offset, chain.response_len, ids, mask, logprobs if has_logprobs else None, starts, decode,
                   _images(chain, part, offset, len(ids)))


def _images(chain: ChainState, part: str, offset: int, count: int) -> list[ImageSpan]:
    """The chain's images (of this part) whose placeholder runs meet tokens ``[offset, offset + count)`` of it."""
    prompt = part == "prompt"
    base = 0 if prompt else chain.prompt_len
    return [ImageSpan(digest=image.digest, media_type=image.media_type, width=image.width, height=image.height,
                      offset=image.offset - base, tokens=image.tokens)
            for image in chain.images
            if (image.offset < chain.prompt_len) == prompt
            and image.offset - base + image.tokens > offset and image.offset - base < offset + count]


def _window(part: str, offset: int, length: int, ids: list[int], mask: list[int],
            logprobs: list[float | None] | None, starts: list[int], decode: Decode | None,
            images: list[ImageSpan]) -> TokenWindow:
    after = offset + len(ids)
    return TokenWindow(part=part, offset=offset, length=length, ids=ids,
                       text=token_texts(ids, decode) if decode is not None else None, mask=mask,
                       logprobs=logprobs, turn_starts=starts, next_offset=after if after < length else None,
                       images=images)
