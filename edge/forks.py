"""Why a request starts a new chain, and from where: the fork classifier. Pure.

A request that continues no chain (:mod:`session.chains`) starts one. Its *parent* is the chain
whose history shares the longest message prefix with the request (ties: the earliest chain), its
*fork point* the number of messages they share (and, computed by the caller, the tokens), and its
*cause* is read from what differs, in this order:

- ``new_conversation``: the session's first chain; or a request sharing no conversation (no
  message past the system prompt) with any chain, with the system prompt and tools of the session's
  first chain (a new task for the main agent);
- ``history_compacted``: earlier messages dropped or summarised. The request repeats, after the
  fork, messages the parent has further on (the ones before them dropped), or the first differing
  message stands for at least 3 of the parent's, is shorter than they are, and half of its words
  (4 letters or more) are theirs, more of them from those after the first than from the first (a
  summary of what happened, not an edit of the message it replaces);
- ``sub_agent``: a request sharing no conversation with any chain, whose system prompt or tool set
  differs from the first chain's (Claude Code's Agent tool, a planner calling a worker). Its parent
  is the latest chain with other system prompt or tools whose last reply called a tool (the caller
  waiting for it), else the session's first chain;
- ``system_changed`` / ``tools_changed``: the conversation is the parent's, under another system
  prompt / tool set;
- ``sibling``: the same history (the request's messages are all the parent's, or the parent's all
  the request's while the parent is busy): a concurrent or repeated sample;
- ``tool_calls_as_text``: at the fork, the parent's reply called tools and the request's
  assistant message has no calls but names them in its text (smolagents' ``Calling tools:``);
- ``reasoning_dropped``: at the fork, the two assistant messages are the same once reasoning
  (``<think>`` blocks, the reply's reasoning) is taken out of their text;
- ``history_rewritten``: anything else (an earlier message edited).

:func:`reserialized_continuation` serves a session's ``continue_reserialized_turns`` setting: a
request that is a chain's whole history with only such re-serialised replies (the text differs,
the conversation does not) continues that chain with its logged tokens instead of forking.

Messages are compared in the canonical form chains are matched with (:mod:`edge.chat.digest`:
tool-call ids, argument JSON formatting and reasoning fields do not count).
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from edge.chat.conversation import Conversation, Message, ToolSpec
from edge.chat.digest import extend, tools_digest
from schemas.bodies import rebuild
from schemas.errors import RollbusError
from schemas.events import FORK_CAUSES, ForkPoint, RequestReceived
from session.fold import SessionState

__all__ = ["CONTINUABLE", "FORK_CAUSES", "ForkPoint", "Histories", "History", "classify", "history", "message_key",
           "recover_histories", "reserialized_continuation"]

SIBLING = "sibling"
SUB_AGENT = "sub_agent"
HISTORY_REWRITTEN = "history_rewritten"
HISTORY_COMPACTED = "history_compacted"
REASONING_DROPPED = "reasoning_dropped"
TOOLS_CHANGED = "tools_changed"
SYSTEM_CHANGED = "system_changed"
TOOL_CALLS_AS_TEXT = "tool_calls_as_text"
NEW_CONVERSATION = "new_conversation"
UNKNOWN = "unknown"  # no chain's history is known here (taken over from another edge, and not recoverable)

SUMMARY_WORDS = 0.5  # share of a summary's words that must come from the messages it replaces
MIN_SUMMARY_WORDS = 5
MIN_REPLACED = 3  # a summary stands for at least this many messages
SCANNED_CHARS = 256 * 1024  # of the messages a summary may stand for, the words of this many characters are read
COMPACTION_CANDIDATES = 8  # a request sharing no conversation is compared with this many latest chains
_ROOT = b""
_WORD = re.compile(r"[a-z0-9]{4,}")
_THINK = re.compile(r"<think>.*?</think>|^.*?</think>", re.DOTALL)


def message_key(message: Message) -> bytes:
    """A message's canonical digest (what chain matching compares)."""
    return extend(_ROOT, message)


class History:
    """A chain's history at its tip (its last reply included), as the edge last saw it. Its messages'
    keys are computed when a fork first compares with it (a turn only remembers the history)."""

    def __init__(self, index: int, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> None:
        self.index = index
        self.messages = tuple(messages)
        self.tools = tuple(tools)

    @functools.cached_property
    def keys(self) -> tuple[bytes, ...]:
        """:func:`message_key` of each message."""
        return tuple(message_key(m) for m in self.messages)

    @functools.cached_property
    def n_system(self) -> int:
        return _n_system(self.messages)


def history(index: int, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> History:
    return History(index, messages, tools)


def _n_system(messages: Sequence[Message]) -> int:
    n = 0
    while n < len(messages) and messages[n].role == "system":
        n += 1
    return n


def _common(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Request:
    def __init__(self, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> None:
        self.messages = messages
        self.keys = [message_key(m) for m in messages]
        self.n_system = _n_system(messages)
        self.tools = tools_digest(tuple(tools))

    def shared(self, chain: History) -> tuple[int, int]:
        """Messages shared from the start, and from the first message past the system prompts."""
        return (_common(self.keys, chain.keys),
                _common(self.keys[self.n_system:], chain.keys[chain.n_system:]))

    def same_system(self, chain: History) -> bool:
        return self.keys[: self.n_system] == list(chain.keys[: chain.n_system])

    def same_tools(self, chain: History) -> bool:
        return self.tools == tools_digest(chain.tools)


def classify(messages: Sequence[Message], tools: Sequence[ToolSpec], chains: Sequence[History],
             *, had_chains: bool | None = None) -> ForkPoint:
    """The fork a request starting a new chain makes (``token_offset`` left 0 for the caller).

    ``chains``: the histories known of the session's chains; ``had_chains``: whether the session
    has chains at all (default: whether any history is known). A session with chains none of whose
    histories is known gets ``unknown``."""
    if not chains:
        return ForkPoint(cause=UNKNOWN if had_chains else NEW_CONVERSATION)
    request = _Request(messages, tools)
    scored = [(request.shared(c), c) for c in chains]
    (k, kb), parent = max(scored, key=lambda item: (item[0], -item[1].index))
    if kb == 0:
        return _new_conversation(request, chains, k, parent, scored)
    if not request.same_system(parent):
        return ForkPoint(cause=SYSTEM_CHANGED, parent=parent.index, message_index=k)
    if not request.same_tools(parent):
        return ForkPoint(cause=TOOLS_CHANGED, parent=parent.index, message_index=k)
    return ForkPoint(cause=_diverged(messages, parent, k), parent=parent.index, message_index=k)


def _new_conversation(request: _Request, chains: Sequence[History], k: int, parent: History,
                      scored: list[tuple[tuple[int, int], History]]) -> ForkPoint:
    """A request sharing no conversation past the system prompt with any chain."""
    for (shared, _), chain in sorted(scored, key=lambda item: -item[1].index)[:COMPACTION_CANDIDATES]:
        if _compacted(request.messages, chain, shared):
            return ForkPoint(cause=HISTORY_COMPACTED, parent=chain.index, message_index=shared)
    root = min(chains, key=lambda c: c.index)  # the session's first chain: its main conversation
    if request.same_system(root) and request.same_tools(root):
        return ForkPoint(cause=NEW_CONVERSATION, parent=parent.index if k else None, message_index=k)
    caller = next((c for c in sorted(chains, key=lambda c: -c.index) if _waits_on_tool(c)
                   and not (request.same_system(c) and request.same_tools(c))), root)
    return ForkPoint(cause=SUB_AGENT, parent=caller.index, message_index=request.shared(caller)[0])


def _waits_on_tool(chain: History) -> bool:
    last = chain.messages[-1] if chain.messages else None
    return last is not None and last.role == "assistant" and bool(last.tool_calls)


def _diverged(messages: Sequence[Message], parent: History, k: int) -> str:
    """The cause when the request and its parent share system prompt, tools and ``k`` messages."""
    if k >= min(len(messages), len(parent.messages)):
        return SIBLING
    ours, theirs = messages[k], parent.messages[k]
    if ours.role == "assistant" and theirs.role == "assistant":
        if _calls_as_text(theirs, ours):
            return TOOL_CALLS_AS_TEXT
        if _without_reasoning(theirs) == _without_reasoning(ours) and _calls(theirs) == _calls(ours):
            return REASONING_DROPPED
    if _compacted(messages, parent, k):
        return HISTORY_COMPACTED
    return HISTORY_REWRITTEN


def _calls_as_text(sampled: Message, sent: Message) -> bool:
    """The reply called tools; the message sent back in its place calls none but names each in its text."""
    return bool(sampled.tool_calls) and not sent.tool_calls and all(
        call.name in sent.content for call in sampled.tool_calls)


def _calls(message: Message) -> bytes:
    return message_key(Message(role="assistant", tool_calls=message.tool_calls))


def _without_reasoning(message: Message) -> str:
    text = _THINK.sub("", message.content)
    if message.reasoning:
        text = text.replace(message.reasoning, "")
    return " ".join(text.split())


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def _compacted(messages: Sequence[Message], parent: History, k: int) -> bool:
    """Earlier messages dropped (later ones of the parent come back, sooner) or summarised."""
    later = {key: i for i, key in enumerate(parent.keys[k:], k) if i >= max(k, parent.n_system)}
    for position, message in enumerate(messages[k:], k):
        i = later.get(message_key(message))
        if i is not None and i > position:
            return True
    if k >= len(messages) or len(parent.messages) - k < MIN_REPLACED:
        return False
    summary = messages[k].content
    replaced = [_text(m) for m in parent.messages[k:]]
    words = _words(summary)
    if len(words) < MIN_SUMMARY_WORDS or len(summary) >= sum(map(len, replaced)):
        return False
    first, later = _words(replaced[0][:SCANNED_CHARS]), _words(" ".join(replaced[1:])[:SCANNED_CHARS])
    return len(words & later) > len(words & first) and len(words & (first | later)) >= SUMMARY_WORDS * len(words)


def _text(message: Message) -> str:
    return " ".join([message.content, *(f"{c.name} {c.arguments}" for c in message.tool_calls)])


CONTINUABLE = (REASONING_DROPPED, TOOL_CALLS_AS_TEXT)
"""The causes where the text differs but the conversation does not (a session may continue the chain)."""


def reserialized_continuation(messages: Sequence[Message], tools: Sequence[ToolSpec],
                              chains: Sequence[History]) -> tuple[int, int, str] | None:
    """``(chain, n_history, cause)`` when the request is a chain's whole history, some of its replies sent
    back other than sampled (reasoning dropped, tool calls as text: :data:`CONTINUABLE`), then new
    messages (``messages[n_history:]``); else None."""
    if not chains:
        return None
    fork = classify(messages, tools, chains)
    if fork.cause not in CONTINUABLE or fork.parent is None:
        return None
    parent = next(c for c in chains if c.index == fork.parent)
    n = len(parent.messages)
    if len(messages) <= n:
        return None
    for sent, sampled, key in zip(messages[:n], parent.messages, parent.keys, strict=True):
        if message_key(sent) != key and not _same_reply(sampled, sent):
            return None
    return parent.index, n, fork.cause


def _same_reply(sampled: Message, sent: Message) -> bool:
    """The reply as sampled and as sent back, told apart only by its reasoning or its calls written as text."""
    if sampled.role != "assistant" or sent.role != "assistant":
        return False
    return _calls_as_text(sampled, sent) or (_without_reasoning(sampled) == _without_reasoning(sent)
                                             and _calls(sampled) == _calls(sent))


class Histories:
    """The latest history of a session's chains as this edge saw them (their last request's messages
    and reply), for :func:`classify`: edge memory, not the log's. The last ``keep`` chains used are
    kept, and the session's first chain always.

    A session this edge took over (``recoverable``: it had chains when it was loaded) knows none of
    its earlier chains: the first request that would fork has them recovered from the log once
    (:func:`recover_histories`); a chain that cannot be recovered is left out, and a fork whose
    session has chains but none known gets ``unknown``."""

    def __init__(self, keep: int = 16, *, recoverable: bool = False) -> None:
        self._keep = keep
        self._by_chain: OrderedDict[int, History] = OrderedDict()
        self._recoverable = recoverable

    def remember(self, chain: int, messages: Sequence[Message], tools: Sequence[ToolSpec]) -> None:
        self._put(history(chain, messages, tools))

    def _put(self, known: History) -> None:
        self._by_chain[known.index] = known
        self._by_chain.move_to_end(known.index)
        while len(self._by_chain) > self._keep:
            oldest = next(c for c in self._by_chain if c != min(self._by_chain))
            del self._by_chain[oldest]

    def known(self) -> list[History]:
        return sorted(self._by_chain.values(), key=lambda h: h.index)

    @property
    def to_recover(self) -> bool:
        """Whether the chains this edge did not see are still to be recovered from the log."""
        return self._recoverable

    def recovered(self, histories: Sequence[History]) -> None:
        """The chains' histories as recovered from the log (those this edge knows since stay as they are)."""
        self._recoverable = False
        for found in sorted(histories, key=lambda h: h.index):
            if found.index not in self._by_chain:
                self._put(found)


def recover_histories(events: Sequence[object], state: SessionState,
                      decoders: Mapping[str, Callable[[bytes], Conversation]]) -> list[History]:
    """The chains' histories from the session's log: each chain's last request, decoded on its wire,
    and the reply its turn recorded. A request that continues a stored response (its history is not
    in its body) or that no decoder takes now is left out."""
    bodies = rebuild(events)
    wires = {e.request_no: e.wire for e in events if isinstance(e, RequestReceived)}
    found = []
    for chain in state.chains:
        if not chain.turns:
            continue
        turn = chain.turns[-1]
        decode = decoders.get(wires.get(turn.request_no, ""))
        if decode is None:
            continue
        try:
            conversation = decode(bodies.body(turn.request_no))
        except (RollbusError, KeyError):
            continue
        if conversation.continues is not None:
            continue
        reply = Message(role="assistant", content=turn.text, tool_calls=turn.tool_calls, reasoning=turn.reasoning)
        found.append(history(chain.index, (*conversation.messages, reply), conversation.tools))
    return found
