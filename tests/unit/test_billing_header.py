"""Claude Code's ``x-anthropic-billing-header: ...`` first system line changes on every request: the
Anthropic adapter drops it, on both decodings (incremental and by value), so that the system message,
and with it every history digest, is the same whatever the header says."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from edge.chat.conversation import Conversation
from edge.chat.digest import prefix_digests, tools_digest
from edge.wires import anthropic as a
from schemas.errors import MalformedRequest

HEADER = "x-anthropic-billing-header: cc_version=2.0.14.abc; cc_entrypoint=cli; cch={};"
PROMPT = "You are Claude Code, Anthropic's official CLI for Claude."


def body(system: Any, messages: list[dict[str, Any]] | None = None) -> bytes:
    messages = messages or [{"role": "user", "content": "hi"}]
    return json.dumps({"model": "m", "max_tokens": 8, "system": system, "messages": messages}).encode()


def by_value(raw: bytes) -> Conversation:
    conversation = a._decode_by_value(raw)
    digests = tuple(map(bytes.hex, prefix_digests(tools_digest(conversation.tools), conversation.messages)))
    return msgspec.structs.replace(conversation, history_digests=digests)


def plain(conversation: Conversation) -> Conversation:
    return msgspec.structs.replace(conversation, body_digest="", known=None)


def both(raw: bytes) -> Conversation:
    incremental = plain(a.decode_request(raw))
    assert incremental == by_value(raw)
    return incremental


SYSTEMS = {
    "string": lambda cch: f"{HEADER.format(cch)}\n{PROMPT}",
    "own block": lambda cch: [{"type": "text", "text": HEADER.format(cch)},
                              {"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}}],
    "first line of a block": lambda cch: [{"type": "text", "text": f"{HEADER.format(cch)}\n{PROMPT}"}],
}


@pytest.mark.parametrize("shape", list(SYSTEMS))
def test_the_billing_header_line_is_not_in_the_system_message(shape: str) -> None:
    conversation = both(body(SYSTEMS[shape]("00a1f")))
    assert conversation.messages[0].role == "system" and conversation.messages[0].content == PROMPT
    assert "billing" not in conversation.messages[0].content


@pytest.mark.parametrize("shape", list(SYSTEMS))
def test_a_new_header_leaves_the_history_digests_as_they_were(shape: str) -> None:
    first = both(body(SYSTEMS[shape]("11111")))
    second = both(body(SYSTEMS[shape]("22222")))
    assert second.messages == first.messages and second.history_digests == first.history_digests
    assert first == both(body(PROMPT))  # as if the header had never been sent


def test_a_growing_session_with_a_new_header_every_request_keeps_its_history() -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    known = None
    digests: tuple[str, ...] = ()
    for turn in range(4):
        raw = json.dumps({"model": "m", "max_tokens": 8, "messages": history,
                          "system": SYSTEMS["own block"](f"{turn:05x}")}).encode()
        conversation = a.decode_request(raw, known)
        assert plain(conversation) == by_value(raw)
        assert conversation.history_digests[:len(digests)] == digests  # the chain only grows
        known, digests = conversation.known, conversation.history_digests
        history += [{"role": "assistant", "content": f"a{turn}"}, {"role": "user", "content": f"u{turn}"}]


@pytest.mark.parametrize("system", [
    "a prompt\nx-anthropic-billing-header: cch=1;",  # not the first line
    " x-anthropic-billing-header: cch=1;\nprompt",  # not at the start
    [{"type": "text", "text": "prompt"}, {"type": "text", "text": "x-anthropic-billing-header: cch=1;"}],
    "X-Anthropic-Billing-Header: cch=1;\nprompt",  # another spelling: not Claude Code's
])
def test_only_a_leading_billing_header_line_is_dropped(system: Any) -> None:
    conversation = both(body(system))
    joined = system if isinstance(system, str) else "".join(block["text"] for block in system)
    assert conversation.messages[0].content == joined


def test_a_system_prompt_that_is_only_the_header_becomes_no_system_message() -> None:
    conversation = both(body(HEADER.format("0")))
    assert [m.role for m in conversation.messages] == ["user"]


def test_a_refused_system_is_refused_the_same_with_a_header() -> None:
    raw = body([{"type": "text", "text": HEADER.format("0")}, {"type": "image", "source": {}}])
    with pytest.raises(MalformedRequest) as incremental:
        a.decode_request(raw)
    with pytest.raises(MalformedRequest) as by_val:
        a._decode_by_value(raw)
    assert (incremental.value.message, incremental.value.param) == (by_val.value.message, by_val.value.param)
    assert incremental.value.param == "system[1].type"
