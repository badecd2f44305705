"""Message-history digests for chain matching.

A request continues a chain when its messages start with the chain's whole history
(the chain's last reply included). Histories are compared by rolling digests:
``d[i] = H(d[i-1] || canonical(message[i]))`` rooted at a digest of the tools, so a
chain's tip is one 16-byte value and a request's prefixes are one pass over its messages.

Canonical forms ignore what agents legitimately rewrite when they echo a conversation
back: tool-call ids, the formatting of tool-call argument JSON, ``developer`` vs
``system``, text split into parts, ``None`` vs empty content, and reasoning (which many
clients drop). A message's images count by where they stand in its text and what they are: the
sha256 of their bytes (an http(s) image: its URL, fetched or not), so that another image is another history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

import msgspec

from edge.chat.cache import BoundedCache
from edge.chat.conversation import Message, ToolSpec

DIGEST_SIZE = 16


_json = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder(order="sorted")
_tools_cache: BoundedCache[bytes, bytes] = BoundedCache(max_items=1024)
_arguments_cache: BoundedCache[str, bytes] = BoundedCache()


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


_NO_TOOLS = _h(b"")


def canonical_arguments(text: str) -> bytes:
    """Tool-call arguments with JSON formatting normalized; unparseable text as written.

    Cached: an agent echoes the same arguments back on every later turn."""
    canonical = _arguments_cache.get(text)
    if canonical is None:
        try:
            canonical = _json_encoder.encode(_json.decode(text))
        except msgspec.DecodeError:
            canonical = text.strip().encode()
        _arguments_cache.put(text, canonical, 2 * len(text))
    return canonical


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "little") + value


_EXTENDED: BoundedCache[tuple[bytes, Message], bytes] = BoundedCache()


def extend(previous: bytes, message: Message) -> bytes:
    """The digest of a history one message longer. Cached, since every request repeats its history."""
    digest = _EXTENDED.get((previous, message))
    if digest is None:
        size = len(message.content) + sum(len(image.data) for image in message.images)  # (the key holds them)
        digest = _EXTENDED.put((previous, message), _extend(previous, message), size)
    return digest


def _extend(previous: bytes, message: Message) -> bytes:
    """One hash per message, fields length-prefixed."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_SIZE)
    h.update(_field(message.role.encode()))
    h.update(_field(message.content.encode()))
    for call in message.tool_calls:
        h.update(_field(call.name.encode()))
        h.update(_field(canonical_arguments(call.arguments)))
    for image in message.images:  # (none: the digest of a text-only message is as it always was)
        identity = image.url.encode() if image.url else \
            bytes.fromhex(image.info.digest) if image.info is not None else hashlib.sha256(image.data).digest()
        h.update(_field(b"image:%d:" % image.at + identity))
    return h.digest()


def tools_digest(tools: Sequence[ToolSpec]) -> bytes:
    """Digest of the tool specs (key order and JSON formatting do not matter)."""
    if not tools:
        return _NO_TOOLS
    canonical = _json_encoder.encode([[t.name, t.description or "", t.parameters or {}] for t in tools])
    digest = _tools_cache.get(canonical)
    if digest is None:
        digest = _tools_cache.put(canonical, _h(canonical), len(canonical))
    return digest


_BY_RAW: BoundedCache[tuple[bytes, bytes], tuple[Message, bytes]] = BoundedCache()


def decode_history(root: bytes, raws: Iterable[bytes], decode: Callable[[int, bytes], Message], *,
                   first_index: int = 0) -> tuple[tuple[Message, ...], tuple[str, ...]]:
    """Messages from their raw JSON, with :func:`prefix_digests` of them (hex), in one pass.

    For a wire that hands over each message's raw JSON (OpenAI's): a message is decoded and
    hashed once per history it follows, (previous digest, raw JSON) being the key, so a
    resent history costs one lookup a message. ``decode(index, raw)`` decodes a miss.

    ``root`` is the digest the first of ``raws`` follows (the tools digest, or the digest of the
    history before them, which then starts at ``first_index``)."""
    messages: list[Message] = []
    digests: list[bytes] = []
    current = root
    for index, raw in enumerate(raws, first_index):
        known = _BY_RAW.get((current, raw))
        if known is None:
            message = decode(index, raw)
            known = _BY_RAW.put((current, raw), (message, extend(current, message)), 2 * len(raw))
        messages.append(known[0])
        current = known[1]
        digests.append(current)
    return tuple(messages), tuple(map(bytes.hex, digests))


_BY_INDEXED_RAW: BoundedCache[tuple[bytes, int, bytes], tuple[tuple[Message, ...], tuple[str, ...], bytes]] = \
    BoundedCache()


def decode_expanding_history(root: bytes, raws: Iterable[tuple[int, bytes]],
                             decode: Callable[[int, bytes], tuple[Message, ...]]
                             ) -> tuple[tuple[Message, ...], tuple[str, ...], bytes]:
    """:func:`decode_history` for a wire whose message becomes any number of messages (Anthropic's:
    a user message's text and tool results are several; an empty system prompt is none) and whose
    decoding of a message may depend on where it stands in the request (a default tool-call id
    names it).

    ``raws`` are ``(index, raw JSON)``; ``decode(index, raw)`` decodes a miss. Since the digests
    ignore what tells such wire messages apart (tool-call ids), the same previous digest can come
    at different indices: (previous digest, index, raw JSON) is the key. The digests come back hex,
    as remembered: a resent history costs one lookup a wire message. The third item is the digest
    after the last of them (``root`` when there is none)."""
    messages: list[Message] = []
    digests: list[str] = []
    current = root
    for index, raw in raws:
        key = (current, index, raw)
        known = _BY_INDEXED_RAW.get(key)
        if known is None:
            decoded = decode(index, raw)
            chain: list[str] = []
            after = current
            for message in decoded:
                after = extend(after, message)
                chain.append(after.hex())
            known = _BY_INDEXED_RAW.put(key, (decoded, tuple(chain), after), 2 * len(raw))
        messages += known[0]
        digests += known[1]
        current = known[2]
    return tuple(messages), tuple(digests), current


def prefix_digests(root: bytes, messages: Sequence[Message]) -> list[bytes]:
    """``out[i]`` is the digest of ``messages[: i + 1]`` under ``root`` (the tools digest)."""
    out: list[bytes] = []
    current = root
    for message in messages:
        current = extend(current, message)
        out.append(current)
    return out
