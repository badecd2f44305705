"""Message-history digests for chain matching.

A request continues a chain when its messages start with the chain's whole history
(the chain's last reply included). Histories are compared by rolling digests:
``d[i] = H(d[i-1] || H(canonical(message[i])))`` rooted at a digest of the tools, so a
chain's tip is one 16-byte value and a request's prefixes are one pass over its messages.

Canonical forms ignore what agents legitimately rewrite when they echo a conversation
back: tool-call ids, the formatting of tool-call argument JSON, ``developer`` vs
``system``, text split into parts, ``None`` vs empty content, and reasoning (which many
clients drop).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from edge.codec.conversation import Message, ToolSpec

DIGEST_SIZE = 16
_SEP = b"\x1f"


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def canonical_arguments(text: str) -> str:
    """Tool-call arguments with JSON formatting normalized; unparseable text as written."""
    try:
        value = json.loads(text)
    except ValueError:
        return text.strip()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_digest(message: Message) -> bytes:
    parts = [message.role.encode(), message.content.encode()]
    for call in message.tool_calls:
        parts.append(call.name.encode())
        parts.append(canonical_arguments(call.arguments).encode())
    return _h(_SEP.join(parts))


def tools_digest(tools: Sequence[ToolSpec]) -> bytes:
    canonical = [
        json.dumps([t.name, t.description or "", t.parameters or {}], sort_keys=True, separators=(",", ":"))
        for t in tools
    ]
    return _h("\n".join(canonical).encode())


def extend(previous: bytes, message: Message) -> bytes:
    return _h(previous + message_digest(message))


def prefix_digests(root: bytes, messages: Sequence[Message]) -> list[bytes]:
    """``out[i]`` is the digest of ``messages[: i + 1]`` under ``root`` (the tools digest)."""
    out: list[bytes] = []
    current = root
    for message in messages:
        current = extend(current, message)
        out.append(current)
    return out
