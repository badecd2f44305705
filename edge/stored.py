"""What a request may name instead of sending it: a stored conversation, a sampled reasoning.

The Responses API lets an agent continue a response it got (``previous_response_id``) without
sending the history again, and send a reasoning item back as an opaque reference. Both are
resolved here, against the session the request was sent to, before its turn is planned; the
adapter has decoded them wire-neutrally (:attr:`Conversation.continues`, :attr:`Message.reasoning_ref`)
and checked the references' authenticity (:mod:`edge.wires.reasoning_refs`).

**Stored conversations.** A turn whose request asked to be stored (``store``, the Responses API's
default) leaves, on its live session, its conversation without the request's own head (its
``instructions``) and with its reply (reasoning included, as sampled): the history a request
that continues it starts with. Its history digests are kept with it, so that a continuation under
the same tools and head costs no hashing of the history; the continued conversation's digests
then say which chain it extends, exactly as if the agent had sent the history (token-exact: the
chain goes on from its sampled tokens). A live session keeps its last :data:`KEEP` stored
conversations (agents continue the latest). One it does not hold (older, or stored before this
edge restarted or took the session over) is rebuilt from the log (:func:`recover`): the request
bodies the log keeps byte for byte, decoded again by their wire's adapter, each continuation resolved
against the one it continued, and the replies from the fold. Another session's, an unknown one, or
one not stored is a 404, and the agent can send the history instead.

**Reasoning references** are resolved lazily, when a message holding one is rendered (a new
chain's prompt, a rewritten turn): its reasoning is the text the fold holds for the turn it names,
decoded from the exact sampled tokens. A continued chain renders only its new messages: the
reasoning it holds is already there as sampled tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from edge.chat.conversation import Conversation, Message
from edge.chat.digest import extend, prefix_digests, tools_digest
from eventlog.reader import SessionLog
from schemas.bodies import rebuild
from schemas.errors import MalformedRequest, ResponseNotFound, RollbusError
from schemas.events import RequestReceived
from session.fold import SessionState

Decode = Callable[[bytes], Conversation]  # a wire adapter's request decoding

KEEP = 4  # stored conversations a live session keeps (the latest; older ones are rebuilt from the log)


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    messages: tuple[Message, ...]  # the conversation without its request's head, its reply last
    head: tuple[Message, ...]  # the head it was stored under (its digests start with it)
    root: bytes  # the tools digest its digests are rooted at
    digests: tuple[str, ...]  # history digests of head + messages
    options: Any  # the adapter's: what an answer about this response echoes


class StoredConversations:
    """A live session's stored conversations, by request number (the latest :data:`KEEP`)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._stored: OrderedDict[int, Stored] = OrderedDict()
        self.unrecoverable: set[int] = set()  # request numbers the log was read for in vain

    def __len__(self) -> int:
        return len(self._stored)

    def get(self, request_no: int) -> Stored | None:
        return self._stored.get(request_no)

    def put(self, request_no: int, conversation: Conversation, reply: Message, tip: str) -> None:
        """Request ``request_no`` (``conversation``, resolved) was answered ``reply``; ``tip`` is the
        history digest after the reply."""
        head = conversation.messages[: conversation.head]
        digests = conversation.history_digests or tuple(
            map(bytes.hex, prefix_digests(tools_digest(conversation.tools), conversation.messages)))
        self.keep(request_no, Stored(messages=(*conversation.messages[conversation.head:], reply), head=head,
                                     root=tools_digest(conversation.tools), digests=(*digests, tip),
                                     options=conversation.options))

    def keep(self, request_no: int, stored: Stored) -> None:
        self._stored[request_no] = stored
        self._stored.move_to_end(request_no)
        while len(self._stored) > self._keep:
            self._stored.popitem(last=False)


def resolve(conversation: Conversation, session_id: str, stored: StoredConversations) -> Conversation:
    """The conversation with what it names resolved in session ``session_id``: its references checked
    to be the session's, and the stored conversation it continues put in place."""
    if conversation.refers_to is not None and conversation.refers_to != session_id:
        raise MalformedRequest("a reasoning item's encrypted_content belongs to another session", param="input")
    continues = conversation.continues
    if continues is None:
        return conversation
    if continues.session_id != session_id:
        raise ResponseNotFound(f"response resp_{continues.session_id}_{continues.request_no} is not one of "
                               f"session {session_id}'s", param="previous_response_id")
    found = stored.get(continues.request_no)
    if found is None:
        raise ResponseNotFound(
            f"session {session_id} holds no stored response {continues.request_no} (unknown, not completed, or "
            "sent with store: false): send the history instead", param="previous_response_id")
    return _continued(conversation, found)


def _continued(conversation: Conversation, found: Stored) -> Conversation:
    head, new = conversation.messages[: conversation.head], conversation.messages[conversation.head:]
    root = tools_digest(conversation.tools)
    if found.root == root and found.head == head:
        digests, current = list(found.digests), bytes.fromhex(found.digests[-1])
    else:  # other tools or instructions: the same messages, other digests
        chain = prefix_digests(root, head + found.messages)
        digests, current = [d.hex() for d in chain], chain[-1]
    for message in new:
        current = extend(current, message)
        digests.append(current.hex())
    return msgspec.structs.replace(conversation, messages=head + found.messages + new, history_digests=tuple(digests))


def recover(events: Sequence[object], state: SessionState, request_no: int, wire: str, decode: Decode) -> Stored | None:
    """The stored conversation of request ``request_no``, rebuilt from the session's log (``events``)
    and fold state; None when it was not a stored one of ``wire`` that completed its turn."""
    bodies = rebuild(events)
    wires = {e.request_no: e.wire for e in events if type(e) is RequestReceived}
    decoded: dict[int, Conversation] = {}
    wanted = request_no
    while True:  # back along its continuations, to one that sent its whole history
        if wires.get(wanted) != wire or state.turn_of(wanted) is None or wanted in decoded:
            return None
        try:
            conversation = decode(bodies.body(wanted))
        except (RollbusError, KeyError):  # refused now (the stack's key changed), or a body not whole
            return None
        if not conversation.store:
            return None
        decoded[wanted] = conversation
        if conversation.continues is None:
            break
        if conversation.continues.session_id != state.session_id or conversation.continues.request_no >= wanted:
            return None
        wanted = conversation.continues.request_no
    store = StoredConversations(keep=len(decoded))
    for number in sorted(decoded):  # forward again: each resolved against the one it continued
        resolved = resolve(decoded[number], state.session_id, store)
        _, turn = state.turn_of(number)  # type: ignore[misc]
        reply = Message(role="assistant", content=turn.text, tool_calls=turn.tool_calls)
        tip = extend(bytes.fromhex(resolved.history_digests[-1]), reply).hex()
        store.put(number, resolved, msgspec.structs.replace(reply, reasoning=turn.reasoning), tip)
    return store.get(request_no)


async def held(stored: StoredConversations, state: SessionState, request_no: int, wire: str, decode: Decode | None,
               read: Callable[[], Awaitable[SessionLog]] | None) -> Stored | None:
    """The stored conversation of request ``request_no`` on ``wire``: held in ``stored``, or rebuilt from
    the session's log (``read``) and kept there; the log is read at most once per request number."""
    found = stored.get(request_no)
    if found is not None or read is None or decode is None or request_no in stored.unrecoverable \
            or state.turn_of(request_no) is None:
        return found
    found = recover((await read()).events, state, request_no, wire, decode)
    if found is None:
        stored.unrecoverable.add(request_no)
    else:
        stored.keep(request_no, found)
    return found


def with_reasoning(state: SessionState, messages: Sequence[Message]) -> Sequence[Message]:
    """``messages`` with each reasoning reference's turn's reasoning in place (to be rendered)."""
    if all(m.reasoning_ref is None for m in messages):
        return messages
    out = []
    for message in messages:
        if message.reasoning_ref is not None:
            found = state.turn_of(message.reasoning_ref)
            if found is not None and found[1].reasoning is not None:
                message = msgspec.structs.replace(message, reasoning=found[1].reasoning)
        out.append(message)
    return tuple(out)
