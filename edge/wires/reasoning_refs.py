"""The Responses API's ``encrypted_content`` of a reasoning item, as rollbus writes it: a reference.

An agent that does not let the API store its responses (``store: false``, as Codex) asks for
``include: ["reasoning.encrypted_content"]`` and sends each reasoning item back, with that
opaque string, on its next request. OpenAI puts the encrypted reasoning there; rollbus puts a
*reference* to the turn that sampled it, authenticated with a key of the stack:

    rbr1.<session_id>.<request_no>.<tag>        tag = base64url(HMAC-SHA256(key, "<session_id>.<request_no>")[:18])

The reasoning text itself is the session's (the fold's ``Turn.reasoning``, decoded from the exact
sampled tokens): the edge puts it back where the item stands when that message is rendered
again, whatever summary the agent sent with it. An agent cannot forge or alter a reference (the
tag), nor use one of another session (the session id is under the tag, and the edge checks it is
the session the request was sent to): either is a 400.

The key (:func:`stack_key`) is derived from the stack's admin token, which every edge of a
stack is given (``--admin-token`` / ``ROLLBUS_ADMIN_TOKEN``), so a reference issued by one edge
is recognised by another, and after a restart. An edge without an admin token draws a random key
when it starts: its references are then recognised only until it stops. Changing the admin token
invalidates the references issued before (their items are refused with a 400).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

from schemas.errors import MalformedRequest

PREFIX = "rbr1"
_TAG_BYTES = 18
_REF = re.compile(r"rbr1\.([0-9a-z]{1,64})\.([1-9][0-9]{0,9})\.([A-Za-z0-9_-]{24})")
_MAX_CHARS = 128


def stack_key(admin_token: str) -> bytes:
    """The key references are authenticated with: derived from the admin token, else random."""
    if not admin_token:
        return secrets.token_bytes(32)
    return hashlib.sha256(b"rollbus/responses/encrypted_content\0" + admin_token.encode("utf-8", "surrogatepass")
                          ).digest()


class ReasoningRefs:
    """Issues and checks references under one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _tag(self, session_id: str, request_no: int) -> str:
        mac = hmac.new(self._key, f"{session_id}.{request_no}".encode(), hashlib.sha256).digest()[:_TAG_BYTES]
        return base64.urlsafe_b64encode(mac).decode()

    def issue(self, session_id: str, request_no: int) -> str:
        return f"{PREFIX}.{session_id}.{request_no}.{self._tag(session_id, request_no)}"

    def check(self, text: str, param: str) -> tuple[str, int]:
        """``(session_id, request_no)`` of a reference this stack issued; else a 400 naming ``param``."""
        match = _REF.fullmatch(text) if len(text) <= _MAX_CHARS else None
        if match is None:
            raise MalformedRequest("encrypted_content is not a reasoning reference of this rollbus stack "
                                   "(rollbus issues its own; content encrypted elsewhere cannot be read)", param=param)
        session_id, request_no = match[1], int(match[2])
        if not hmac.compare_digest(match[3], self._tag(session_id, request_no)):
            raise MalformedRequest("encrypted_content was not issued by this rollbus stack, or was altered",
                                   param=param)
        return session_id, request_no
