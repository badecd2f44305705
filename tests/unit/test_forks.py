"""The fork classifier (pure): one realistic conversation per cause, and properties over generated ones."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from edge.chat.conversation import Message, ToolSpec
from edge.forks import (
    FORK_CAUSES,
    HISTORY_COMPACTED,
    HISTORY_REWRITTEN,
    NEW_CONVERSATION,
    REASONING_DROPPED,
    SIBLING,
    SUB_AGENT,
    SYSTEM_CHANGED,
    TOOL_CALLS_AS_TEXT,
    TOOLS_CHANGED,
    UNKNOWN,
    Histories,
    classify,
    history,
    reserialized_continuation,
)
from schemas.events import ToolCall

SYSTEM = Message(role="system", content="You are a coding agent. Use the tools to inspect and edit the repository.")
TOOLS = (ToolSpec(name="read_file", parameters={"type": "object", "properties": {"path": {"type": "string"}}}),
         ToolSpec(name="run_tests", parameters={"type": "object", "properties": {}}),
         ToolSpec(name="Task", parameters={"type": "object", "properties": {"prompt": {"type": "string"}}}))
TASK = Message(role="user", content="The parser drops trailing commas in lists. Find out why and fix it.")


def call(name: str, arguments: str, id: str = "call_1") -> ToolCall:
    return ToolCall(id=id, name=name, arguments=arguments)


READ = Message(role="assistant", content="Let me look at the parser.",
               tool_calls=(call("read_file", '{"path": "parser/lists.py"}'),))
READ_RESULT = Message(role="tool", tool_call_id="call_1",
                      content="def parse_list(tokens):\n    items = []\n    while tokens.peek() != ']':\n"
                              "        items.append(parse_value(tokens))\n        if tokens.peek() == ',':\n"
                              "            tokens.next()\n    return items")
TEST = Message(role="assistant", content="The loop looks right; let me run the tests.",
               tool_calls=(call("run_tests", "{}", "call_2"),))
TEST_RESULT = Message(role="tool", tool_call_id="call_2",
                      content="FAILED tests/test_lists.py::test_trailing_comma - "
                              "AssertionError: [1, 2] != [1, 2, None]")
FIX = Message(role="assistant", content="The trailing comma makes parse_value read the closing bracket; "
                                        "I will stop the loop after a comma followed by ']'.")
MAIN = (SYSTEM, TASK, READ, READ_RESULT, TEST, TEST_RESULT, FIX)


def main_chain(messages=MAIN, index: int = 0, tools=TOOLS):
    return history(index, messages, tools)


def test_the_first_chain_is_a_new_conversation():
    fork = classify([SYSTEM, TASK], TOOLS, [])
    assert (fork.cause, fork.parent, fork.message_index) == (NEW_CONVERSATION, None, 0)


def test_a_session_whose_chain_histories_are_not_known_gets_unknown():
    assert classify([SYSTEM, TASK], TOOLS, [], had_chains=True).cause == UNKNOWN


def test_sibling_same_history_sampled_again():
    chain = main_chain(MAIN[:3])
    fork = classify(MAIN[:2], TOOLS, [chain])
    assert (fork.cause, fork.parent, fork.message_index) == (SIBLING, 0, 2)


def test_sibling_concurrent_on_the_same_tip():
    """The parent is busy with the same request: the request holds all of its history."""
    chain = main_chain(MAIN[:3])
    fork = classify([*MAIN[:3], READ_RESULT], TOOLS, [chain])
    assert (fork.cause, fork.parent, fork.message_index) == (SIBLING, 0, 3)


def test_sub_agent_another_system_prompt_and_tools_opening_a_conversation():
    spawn = Message(role="assistant", content="I'll ask a sub-agent to search the tests.",
                    tool_calls=(call("Task", '{"prompt": "List every test about trailing commas."}'),))
    main = main_chain((SYSTEM, TASK, spawn))
    sub_system = Message(role="system", content="You are a search agent. Answer with file paths only.")
    sub_tools = (ToolSpec(name="grep", parameters={"type": "object"}),)
    fork = classify([sub_system, Message(role="user", content="List every test about trailing commas.")],
                    sub_tools, [main])
    assert (fork.cause, fork.parent, fork.message_index) == (SUB_AGENT, 0, 0)


def test_a_second_sub_agent_hangs_off_the_caller_not_off_the_first_sub_agent():
    spawn = Message(role="assistant", content="", tool_calls=(call("Task", '{"prompt": "a"}'),
                                                              call("Task", '{"prompt": "b"}', "call_2")))
    sub_system = Message(role="system", content="You are a search agent.")
    sub_tools = (ToolSpec(name="grep"),)
    first = history(1, [sub_system, Message(role="user", content="a"),
                        Message(role="assistant", content="", tool_calls=(call("grep", '{"q": "a"}'),))], sub_tools)
    fork = classify([sub_system, Message(role="user", content="b")], sub_tools,
                    [main_chain((SYSTEM, TASK, spawn)), first])
    assert (fork.cause, fork.parent) == (SUB_AGENT, 0)


def test_new_conversation_same_system_and_tools_another_task():
    other = Message(role="user", content="Now write the changelog entry for release 2.3.")
    fork = classify([SYSTEM, other], TOOLS, [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (NEW_CONVERSATION, 0, 1)


def test_history_compacted_summarised():
    summary = Message(role="user", content=(
        "This session continues an earlier conversation, summarised: the parser (parser/lists.py) drops "
        "trailing commas; read_file showed parse_list; run_tests failed test_trailing_comma with [1, 2] != "
        "[1, 2, None]. Continue with the fix."))
    fork = classify([SYSTEM, summary], TOOLS, [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (HISTORY_COMPACTED, 0, 1)


def test_history_compacted_earlier_messages_dropped():
    fork = classify([SYSTEM, TASK, TEST, TEST_RESULT, FIX, Message(role="user", content="go on")], TOOLS,
                    [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (HISTORY_COMPACTED, 0, 2)


def test_history_rewritten_an_earlier_reply_edited():
    edited = Message(role="assistant", content="Running the tests first.",
                     tool_calls=(call("run_tests", "{}"),))
    fork = classify([SYSTEM, TASK, edited, Message(role="tool", content="2 passed", tool_call_id="call_1")],
                    TOOLS, [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (HISTORY_REWRITTEN, 0, 2)


def test_an_edited_question_is_rewritten_not_compacted():
    edited = Message(role="user", content="The parser drops trailing commas in lists and in dicts. Find out why.")
    fork = classify([SYSTEM, edited], TOOLS, [main_chain()])
    assert fork.cause in (NEW_CONVERSATION, HISTORY_REWRITTEN) and fork.cause != HISTORY_COMPACTED


def test_reasoning_dropped_think_block_left_out_of_the_text():
    sampled = Message(role="assistant", content="<think>The user wants the bug found first.</think>Let me look.",
                      tool_calls=READ.tool_calls)
    sent = Message(role="assistant", content="Let me look.", tool_calls=READ.tool_calls)
    fork = classify([SYSTEM, TASK, sent, READ_RESULT], TOOLS, [main_chain((SYSTEM, TASK, sampled))])
    assert (fork.cause, fork.parent, fork.message_index) == (REASONING_DROPPED, 0, 2)


def test_reasoning_put_back_into_the_text_counts_too():
    sampled = Message(role="assistant", content="Let me look.", reasoning="Find the bug first.",
                      tool_calls=READ.tool_calls)
    sent = Message(role="assistant", content="<think>Find the bug first.</think>\n\nLet me look.",
                   tool_calls=READ.tool_calls)
    assert classify([SYSTEM, TASK, sent, READ_RESULT], TOOLS,
                    [main_chain((SYSTEM, TASK, sampled))]).cause == REASONING_DROPPED


def test_tool_calls_as_text_smolagents():
    sent = Message(role="assistant", content=(
        "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {'name': 'read_file', "
        "'arguments': {'path': 'parser/lists.py'}}}]"))
    observation = Message(role="user", content="Observation:\n" + READ_RESULT.content)
    fork = classify([SYSTEM, TASK, sent, observation], TOOLS, [main_chain((SYSTEM, TASK, READ))])
    assert (fork.cause, fork.parent, fork.message_index) == (TOOL_CALLS_AS_TEXT, 0, 2)


def test_tools_changed():
    fewer = TOOLS[:2]
    fork = classify([*MAIN, Message(role="user", content="thanks")], fewer, [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (TOOLS_CHANGED, 0, 7)


def test_system_changed():
    system = Message(role="system", content="You are a careful coding agent. Today is Tuesday.")
    fork = classify([system, *MAIN[1:], Message(role="user", content="thanks")], TOOLS, [main_chain()])
    assert (fork.cause, fork.parent, fork.message_index) == (SYSTEM_CHANGED, 0, 0)


def test_the_parent_is_the_chain_sharing_the_longest_prefix():
    short = main_chain(MAIN[:3], index=0)
    long = main_chain(MAIN[:5], index=1)
    other = history(2, [SYSTEM, Message(role="user", content="unrelated")], TOOLS)
    edited = Message(role="assistant", content="Different.")
    fork = classify([*MAIN[:4], edited], TOOLS, [short, long, other])
    assert (fork.parent, fork.message_index, fork.cause) == (1, 4, HISTORY_REWRITTEN)


ROLES = st.sampled_from(["user", "assistant", "tool"])
MESSAGES = st.lists(st.builds(Message, role=ROLES, content=st.sampled_from(["a", "b", "c d e", "f"])),
                    min_size=1, max_size=8)


@given(MESSAGES, st.lists(MESSAGES, min_size=1, max_size=4))
def test_every_fork_names_a_known_parent_and_a_shared_prefix(messages, histories):
    chains = [history(i, [SYSTEM, *h], TOOLS) for i, h in enumerate(histories)]
    request = [SYSTEM, *messages]
    fork = classify(request, TOOLS, chains)
    assert fork.cause in FORK_CAUSES
    if fork.parent is not None:
        parent = chains[fork.parent]
        assert list(parent.keys[: fork.message_index]) == [history(0, request).keys[i]
                                                            for i in range(fork.message_index)]
    best = max(len(history(0, request).keys) and _shared(request, c) for c in chains)
    if fork.cause not in (SUB_AGENT, HISTORY_COMPACTED):
        assert fork.message_index == best


@given(MESSAGES, st.lists(MESSAGES, min_size=1, max_size=4))
def test_a_request_that_repeats_a_chain_prefix_is_a_sibling(extra, histories):
    chains = [history(i, [SYSTEM, *h], TOOLS) for i, h in enumerate(histories)]
    base = chains[-1].messages
    for n in range(2, len(base) + 1):
        fork = classify(base[:n], TOOLS, chains)
        assert fork.cause == SIBLING and fork.message_index == n


def _shared(request, chain):
    keys = history(0, request).keys
    n = 0
    while n < min(len(keys), len(chain.keys)) and keys[n] == chain.keys[n]:
        n += 1
    return n


def test_histories_keep_the_latest_chains_and_always_the_first():
    kept = Histories(keep=3)
    for chain in range(6):
        kept.remember(chain, [SYSTEM, Message(role="user", content=str(chain))], TOOLS)
    kept.remember(4, [*MAIN], TOOLS)
    assert [h.index for h in kept.known()] == [0, 4, 5]
    assert kept.known()[1].messages == MAIN


def test_a_re_serialised_history_continues_only_when_nothing_else_differs():
    as_text = Message(role="assistant", content=(
        "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {'name': 'read_file', "
        "'arguments': {'path': 'parser/lists.py'}}}]"))
    observation = Message(role="user", content="Observation:\n" + READ_RESULT.content)
    chain = main_chain((SYSTEM, TASK, READ))
    assert reserialized_continuation([SYSTEM, TASK, as_text, observation], TOOLS, [chain]) == \
        (0, 3, TOOL_CALLS_AS_TEXT)
    assert reserialized_continuation([SYSTEM, TASK, as_text], TOOLS, [chain]) is None  # nothing new
    edited = Message(role="user", content="Fix the dict parser instead.")
    assert reserialized_continuation([SYSTEM, edited, as_text, observation], TOOLS, [chain]) is None
    assert reserialized_continuation([SYSTEM, TASK, as_text, observation], TOOLS[:1], [chain]) is None
    assert reserialized_continuation([SYSTEM, TASK, as_text, observation], TOOLS, []) is None
