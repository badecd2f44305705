"""Table-driven chain selection over digests (pure)."""

import msgspec
import pytest

from edge.chat import digest
from edge.chat.conversation import Message, ToolSpec
from edge.chat.digest import prefix_digests, tools_digest
from schemas.events import ToolCall
from session.chains import Continue, Exhausted, NewChain, Rollback, select_chain
from session.fold import fold
from tests.helpers import SessionScript

SYS = Message(role="system", content="be brief")
U1 = Message(role="user", content="hi")
A1 = Message(role="assistant", content="", tool_calls=(ToolCall(id="call_1_0", name="f", arguments='{"x": 1}'),))
T1 = Message(role="tool", content="42", tool_call_id="call_1_0")
A2 = Message(role="assistant", content="done")
U2 = Message(role="user", content="again")
ROOT = tools_digest([ToolSpec(name="f")])


def hexes(messages, root=ROOT):
    return [d.hex() for d in prefix_digests(root, messages)]


def state_with(*chains):
    """A session whose chains have the given histories (each ending with an assistant reply)."""
    script = SessionScript()
    for index, (history, closed) in enumerate(chains):
        tip = hexes(history)[-1]
        script.turn(index, [1, 2], [3], new_chain=True, n_messages=len(history) - 1, tip=tip)
        if closed:
            script.close(index)
    return fold(script.events)


CASES = {
    "first request starts a chain": ([], [SYS, U1], NewChain, None),
    "continuation": ([([SYS, U1, A1], False)], [SYS, U1, A1, T1], Continue, 0),
    "longest history wins": ([([SYS, U1, A1], False), ([SYS, U1, A1, T1, A2], False)],
                             [SYS, U1, A1, T1, A2, U2], Continue, 1),
    "sibling sample (same prompt) diverges": ([([SYS, U1, A1], False)], [SYS, U1], NewChain, None),
    "rewritten history diverges": ([([SYS, U1, A1], False)], [SYS, U2, A1, T1], NewChain, None),
    "compaction diverges": ([([SYS, U1, A1, T1, A2], False)], [SYS, Message(role="user", content="summary"), U2],
                            NewChain, None),
    "request equal to the history is a new sample": ([([SYS, U1, A1], False)], [SYS, U1, A1], NewChain, None),
    "closed chain is exhausted": ([([SYS, U1, A1], True)], [SYS, U1, A1, T1], Exhausted, 0),
}


@pytest.mark.parametrize("chains, messages, kind, index", CASES.values(), ids=CASES.keys())
def test_selection(chains, messages, kind, index):
    selection = select_chain(state_with(*chains), hexes(messages))
    assert isinstance(selection, kind)
    if index is not None:
        assert selection.chain.index == index


def test_busy_chain_is_skipped():
    state = state_with(([SYS, U1, A1], False))
    assert isinstance(select_chain(state, hexes([SYS, U1, A1, T1]), busy={0}), NewChain)


def test_tool_call_ids_and_argument_formatting_do_not_break_matching():
    state = state_with(([SYS, U1, A1], False))
    echoed = msgspec.structs.replace(A1, tool_calls=(ToolCall(id="other", name="f", arguments='{ "x" :1 }'),))
    selection = select_chain(state, hexes([SYS, U1, echoed, T1]))
    assert isinstance(selection, Continue) and selection.n_history == 3


def test_different_tools_do_not_match():
    state = state_with(([SYS, U1, A1], False))
    other_root = tools_digest([ToolSpec(name="g")])
    assert isinstance(select_chain(state, hexes([SYS, U1, A1, T1], other_root)), NewChain)


# --- rollback of a rewritten last reply ------------------------------------------------------

A1_EDITED = Message(role="assistant", content="", tool_calls=(ToolCall(id="x", name="f", arguments='{"x": 2}'),))
T2 = Message(role="tool", content="7", tool_call_id="call_2_0")


def state_with_turns(*chains: list[list[Message]]):
    """Chains whose turns end with the given histories (each history ends with that turn's reply)."""
    script = SessionScript()
    for index, histories in enumerate(chains):
        for turn, history in enumerate(histories):
            prefix = hexes(history[:-1])[-1]
            script.turn(index, [1, 2], [3, 4], new_chain=turn == 0, n_messages=len(history) - 1,
                        tip=hexes(history)[-1], prefix=prefix)
    return fold(script.events)


TWO_TURNS = [[SYS, U1, A1], [SYS, U1, A1, T1, A2]]
ROLES = lambda messages: [m.role for m in messages]  # noqa: E731

ROLLBACK_CASES = {
    "rewritten last reply rolls back": ([TWO_TURNS], [SYS, U1, A1, T1, A1_EDITED, T2], Rollback, 0),
    "rewritten first reply is a new chain": ([[[SYS, U1, A1]]], [SYS, U1, A1_EDITED, T1], NewChain, None),
    "rewrite without anything after it is a new sample": ([TWO_TURNS], [SYS, U1, A1, T1, A1_EDITED], NewChain, None),
    "the exact reply continues instead": ([TWO_TURNS], [SYS, U1, A1, T1, A2, U2], Continue, 0),
    "two chains rewritten at the same depth is ambiguous": ([TWO_TURNS, TWO_TURNS], [SYS, U1, A1, T1, A1_EDITED, T2],
                                                            NewChain, None),
    "a rewritten user message is not a rollback": ([TWO_TURNS], [SYS, U1, A1, T1, U2, T2], NewChain, None),
}


@pytest.mark.parametrize("chains, messages, kind, index", ROLLBACK_CASES.values(), ids=ROLLBACK_CASES.keys())
def test_rollback_selection(chains, messages, kind, index):
    selection = select_chain(state_with_turns(*chains), hexes(messages), roles=ROLES(messages), rollback=True)
    assert isinstance(selection, kind)
    if index is not None:
        assert selection.chain.index == index
    if kind is Rollback:
        assert selection.n_history == 4  # messages[4] is the rewritten reply


def test_rollback_is_off_unless_asked_and_skips_busy_chains():
    state = state_with_turns(TWO_TURNS)
    messages = [SYS, U1, A1, T1, A1_EDITED, T2]
    assert isinstance(select_chain(state, hexes(messages), roles=ROLES(messages)), NewChain)
    assert isinstance(select_chain(state, hexes(messages), busy={0}, roles=ROLES(messages), rollback=True), NewChain)


def test_tools_digest_ignores_key_order_and_is_the_same_for_a_remembered_tuple():
    spec = (ToolSpec(name="f", description="d", parameters={"type": "object", "properties": {"a": {}, "b": {}}}),)
    reordered = (ToolSpec(name="f", description="d", parameters={"properties": {"b": {}, "a": {}}, "type": "object"}),)
    first = tools_digest(spec)
    assert tools_digest(spec) == first == tools_digest(reordered) == tools_digest(list(spec))
    assert tools_digest((ToolSpec(name="f", description="other"),)) != first


def test_history_digests_are_the_same_for_the_same_messages_and_for_equal_copies():
    history = [SYS, U1, A1, T1, A2]
    expected = [_extend_uncached(history[: i + 1]) for i in range(len(history))]
    assert hexes(history) == expected  # computed, then found by object...
    assert hexes(history) == expected
    copies = [msgspec.structs.replace(m) for m in history]  # ...and by value, for equal new objects
    assert hexes(copies) == expected
    assert hexes([SYS, U1, A2]) != hexes([SYS, U1, A1])[:3]


def _extend_uncached(messages):
    current = ROOT
    for message in messages:
        current = digest._extend(current, message)
    return current.hex()
