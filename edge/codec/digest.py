"""Message-history digests for chain matching.

A request continues a chain when its messages start with the chain's whole history
(the chain's last reply included). Histories are compared by rolling digests:
``d[i] = H(d[i-1] || canonical(message[i]))`` rooted at a digest of the tools, so a
chain's tip is one 16-byte value and a request's prefixes are one pass over its messages.

Canonical forms ignore what agents legitimately rewrite when they echo a conversation
back: tool-call ids, the formatting of tool-call argument JSON, ``developer`` vs
``system``, text split into parts, ``None`` vs empty content, and reasoning (which many
clients drop).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from edge.codec.cache import BoundedCache
from edge.codec.conversation import Message, ToolSpec

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
    """The digest of a history one message longer. Cached: every request repeats its history, and
    the wire adapters hand back the same (hashable) message objects for it."""
    key = (previous, message)
    digest = _EXTENDED.get(key)
    if digest is None:
        digest = _EXTENDED.put(key, _extend(previous, message), len(message.content))
    return digest


def _extend(previous: bytes, message: Message) -> bytes:
    """One hash per message, fields length-prefixed."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_SIZE)
    h.update(_field(message.role.encode()))
    h.update(_field(message.content.encode()))
    for call in message.tool_calls:
        h.update(_field(call.name.encode()))
        h.update(_field(canonical_arguments(call.arguments)))
    return h.digest()


_BY_OBJECT: BoundedCache[int, tuple[Sequence[ToolSpec], bytes]] = BoundedCache(max_items=1024)


def tools_digest(tools: Sequence[ToolSpec]) -> bytes:
    """Digest of the tool specs (key order and JSON formatting do not matter). The wire adapters
    hand back one tuple per distinct tools JSON, so its digest is remembered by object (the cache
    holds the tuple, so its id cannot be reused while the entry lives)."""
    if not tools:
        return _NO_TOOLS
    if not isinstance(tools, tuple):  # a list could change after its digest was remembered
        return _tools_digest(tools)
    known = _BY_OBJECT.get(id(tools))
    if known is not None and known[0] is tools:
        return known[1]
    digest = _tools_digest(tools)
    _BY_OBJECT.put(id(tools), (tools, digest))
    return digest


def _tools_digest(tools: Sequence[ToolSpec]) -> bytes:
    canonical = _json_encoder.encode([[t.name, t.description or "", t.parameters or {}] for t in tools])
    digest = _tools_cache.get(canonical)
    if digest is None:
        digest = _tools_cache.put(canonical, _h(canonical), len(canonical))
    return digest


def prefix_digests(root: bytes, messages: Sequence[Message]) -> list[bytes]:
    """``out[i]`` is the digest of ``messages[: i + 1]`` under ``root`` (the tools digest)."""
    out: list[bytes] = []
    current = root
    for message in messages:
        current = extend(current, message)
        out.append(current)
    return out


class HistoryDigests:
    """A session's prefix digests, as hex, with the last request's remembered for the next.

    An agent resends its whole history with every request, and the wire adapters hand back
    the very same message objects for the messages they have seen, so the history the next
    request shares with the last one is found by comparing messages (the same object compares
    at once) and only the new messages are hashed.
    """

    __slots__ = ("_digests", "_hex", "_messages", "_root")

    def __init__(self) -> None:
        self._root = b""
        self._messages: tuple[Message, ...] = ()
        self._digests: list[bytes] = []
        self._hex: list[str] = []

    def of(self, root: bytes, messages: Sequence[Message]) -> list[str]:
        """``out[i]`` is the hex digest of ``messages[: i + 1]`` under ``root`` (do not modify it)."""
        shared = 0
        if root == self._root:
            previous = self._messages
            shared = len(previous)
            # the usual case, the whole last history resent (compared in C: same objects match at once)
            if len(messages) < shared or tuple(messages[:shared]) != previous:
                limit = min(shared, len(messages))
                shared = 0
                while shared < limit and messages[shared] is previous[shared]:
                    shared += 1
        digests, hexes = self._digests[:shared], self._hex[:shared]
        current = digests[-1] if digests else root
        for message in messages[shared:]:
            current = extend(current, message)
            digests.append(current)
            hexes.append(current.hex())
        self._root, self._messages, self._digests, self._hex = root, tuple(messages), digests, hexes
        return hexes
